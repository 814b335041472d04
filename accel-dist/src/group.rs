//! Joining a job: the store and the communicator one process holds.

use std::sync::Arc;

use candle_core::Device;

use crate::backend::{nccl_device, NCCL_COMPILED};
use crate::{
    Backend, Communicator, LocalCommunicator, NcclCommunicator, NcclConfig, ProcessGroupConfig,
    Result, TcpCommunicator, TcpStore,
};

/// This process's membership in a job: its configuration, the rendezvous
/// store (absent in a single-process run) and the communicator.
///
/// Rank 0 hosts the store unless a launcher does; keep the group alive
/// until every rank is done with the store (end with a barrier).
pub struct ProcessGroup {
    config: ProcessGroupConfig,
    device: Device,
    communicator: Arc<dyn Communicator>,
    // Dropped after the communicator: rank 0's store serves the others.
    store: Option<TcpStore>,
}

impl ProcessGroup {
    /// Joins the job `config` describes, for training on the CPU: the
    /// backend it names, where [`Backend::Auto`] means a
    /// [`LocalCommunicator`] for a world of one and the store plus a
    /// [`TcpCommunicator`] otherwise. [`Backend::Nccl`] uses
    /// `cuda:LOCAL_RANK`; see [`init_on`](Self::init_on) to let the training
    /// device decide.
    ///
    /// # Errors
    /// Store and connection errors, naming the address or the missing rank;
    /// for NCCL, CUDA and NCCL errors, or `Error::NotCompiled` without the
    /// `nccl` feature.
    pub fn init(config: ProcessGroupConfig) -> Result<Self> {
        if config.backend == Backend::Nccl {
            let device = nccl_device(config.local_rank)?;
            return Self::init_nccl(config, device);
        }
        Self::init_host(config)
    }

    /// Joins the job for training on `device`: [`Backend::Auto`] picks NCCL
    /// on `device` when it is a CUDA device and this build has the `nccl`
    /// feature (every rank decides alike, since all train on the same kind
    /// of device), the host backends otherwise. [`Backend::Nccl`] uses
    /// `device` when it is a CUDA device, else `cuda:LOCAL_RANK`.
    ///
    /// # Errors
    /// As [`init`](Self::init).
    pub fn init_on(config: ProcessGroupConfig, device: &Device) -> Result<Self> {
        match (config.backend, device.is_cuda()) {
            (Backend::Nccl, true) => Self::init_nccl(config, device.clone()),
            (Backend::Auto, true) if NCCL_COMPILED => Self::init_nccl(config, device.clone()),
            (Backend::Nccl, false) => Self::init(config),
            _ => Self::init_host(config),
        }
    }

    /// The host backends: local for one process, TCP for more.
    fn init_host(config: ProcessGroupConfig) -> Result<Self> {
        if !config.is_distributed() {
            return Ok(Self {
                config,
                device: Device::Cpu,
                communicator: Arc::new(LocalCommunicator::new()),
                store: None,
            });
        }
        let store = TcpStore::from_config(&config)?;
        let comm =
            TcpCommunicator::connect(&store, config.rank, config.world_size, config.timeout)?;
        Ok(Self {
            config,
            device: Device::Cpu,
            communicator: Arc::new(comm),
            store: Some(store),
        })
    }

    fn init_nccl(config: ProcessGroupConfig, device: Device) -> Result<Self> {
        let store = match config.is_distributed() {
            true => Some(TcpStore::from_config(&config)?),
            false => None,
        };
        let nccl = NcclConfig::default().with_timeout(config.timeout);
        let comm = NcclCommunicator::connect(
            store.as_ref(),
            config.rank,
            config.world_size,
            &device,
            nccl,
        )?;
        Ok(Self {
            config,
            device,
            communicator: Arc::new(comm),
            store,
        })
    }

    /// Where the communicator wants tensors: the CUDA device of an NCCL
    /// group, the CPU otherwise.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The configuration the group was built from.
    pub fn config(&self) -> &ProcessGroupConfig {
        &self.config
    }

    /// The communicator, shareable with whatever needs collectives.
    pub fn communicator(&self) -> Arc<dyn Communicator> {
        Arc::clone(&self.communicator)
    }

    /// The rendezvous store, if the job has more than one process.
    pub fn store(&self) -> Option<&TcpStore> {
        self.store.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_for_nccl_without_the_feature_names_it() {
        if NCCL_COMPILED {
            return;
        }
        let cfg = ProcessGroupConfig::default().with_backend(Backend::Nccl);
        let err = ProcessGroup::init(cfg)
            .err()
            .expect("no NCCL in this build");
        assert!(
            matches!(err, crate::Error::NotCompiled { feature: "nccl" }),
            "{err}"
        );
    }

    #[test]
    fn a_world_of_one_needs_no_store() -> Result<()> {
        let group = ProcessGroup::init(ProcessGroupConfig::default())?;
        assert!(group.store().is_none());
        assert_eq!(group.communicator().world_size(), 1);
        Ok(())
    }
}

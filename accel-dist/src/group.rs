//! Joining a job: the store and the communicator one process holds.

use std::sync::Arc;

use candle_core::Device;

use crate::backend::nccl_device;
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
    /// Joins the job `config` describes with the backend it asks for:
    /// [`NcclCommunicator`] on `cuda:LOCAL_RANK` for [`Backend::Nccl`] (and
    /// for [`Backend::Auto`] in a multi-process job when NCCL is compiled in
    /// and the device exists); otherwise a [`LocalCommunicator`] for a world
    /// of one, or the store plus a [`TcpCommunicator`].
    ///
    /// # Errors
    /// Store and connection errors, naming the address or the missing rank;
    /// for NCCL, CUDA and NCCL errors, or `Error::NotCompiled` without the
    /// `nccl` feature.
    pub fn init(config: ProcessGroupConfig) -> Result<Self> {
        let nccl = match config.backend {
            Backend::Nccl => Some(Device::new_cuda(config.local_rank)?),
            Backend::Auto if config.is_distributed() => nccl_device(config.local_rank),
            _ => None,
        };
        if let Some(device) = nccl {
            return Self::init_nccl(config, device);
        }
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
    fn a_world_of_one_needs_no_store() -> Result<()> {
        let group = ProcessGroup::init(ProcessGroupConfig::default())?;
        assert!(group.store().is_none());
        assert_eq!(group.communicator().world_size(), 1);
        Ok(())
    }
}

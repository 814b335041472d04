//! Joining a job: the store and the communicator one process holds.

use std::sync::Arc;

use crate::{
    Communicator, LocalCommunicator, ProcessGroupConfig, Result, TcpCommunicator, TcpStore,
};

/// This process's membership in a job: its configuration, the rendezvous
/// store (absent in a single-process run) and the communicator.
///
/// Rank 0 hosts the store unless a launcher does; keep the group alive
/// until every rank is done with the store (end with a barrier).
pub struct ProcessGroup {
    config: ProcessGroupConfig,
    communicator: Arc<dyn Communicator>,
    // Dropped after the communicator: rank 0's store serves the others.
    store: Option<TcpStore>,
}

impl ProcessGroup {
    /// Joins the job `config` describes: a [`LocalCommunicator`] for a world
    /// of one, otherwise the store plus a [`TcpCommunicator`].
    ///
    /// # Errors
    /// Store and connection errors, naming the address or the missing rank.
    pub fn init(config: ProcessGroupConfig) -> Result<Self> {
        if !config.is_distributed() {
            return Ok(Self {
                config,
                communicator: Arc::new(LocalCommunicator::new()),
                store: None,
            });
        }
        let store = TcpStore::from_config(&config)?;
        let comm =
            TcpCommunicator::connect(&store, config.rank, config.world_size, config.timeout)?;
        Ok(Self {
            config,
            communicator: Arc::new(comm),
            store: Some(store),
        })
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

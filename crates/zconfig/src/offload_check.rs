//! The checks of `zero.offload_optimizer`, `zero.offload_param` and `aio` that
//! need no filesystem: which stages allow which offload, and the settings of
//! the swap I/O. (Whether `nvme_path` is usable is checked where it lives, by
//! zrun before a local launch and by each worker as it starts.)

use crate::error::ConfigError;
use crate::load::LoadedJob;
use crate::spec::{OffloadDevice, OffloadSpec, ZeroStage};

/// The alignment of every swap transfer; `aio.block_size` is a multiple of it.
const PAGE: u64 = 4096;

impl LoadedJob {
    pub(crate) fn validate_offload(&self) -> Result<(), ConfigError> {
        let z = &self.spec.zero;
        if z.offload_optimizer.device != OffloadDevice::None && z.stage == ZeroStage::Disabled {
            return Err(self.invalid(
                "zero.offload_optimizer.device",
                "offloading the optimizer needs zero.stage 1, 2 or 3",
            ));
        }
        if z.offload_param.device != OffloadDevice::None && !z.stage.partitions_parameters() {
            return Err(self.invalid(
                "zero.offload_param.device",
                format!(
                    "offloading parameters needs zero.stage 3, got {}",
                    z.stage.number()
                ),
            ));
        }
        self.check_target("zero.offload_optimizer", &z.offload_optimizer)?;
        self.check_target("zero.offload_param", &z.offload_param)?;
        let a = &self.spec.aio;
        if a.block_size.0 == 0 || !a.block_size.0.is_multiple_of(PAGE) {
            return Err(self.invalid(
                "aio.block_size",
                format!(
                    "must be a positive multiple of 4KiB ({PAGE} bytes), got {}",
                    a.block_size.0
                ),
            ));
        }
        if a.queue_depth == 0 || a.queue_depth > 4096 {
            return Err(self.invalid("aio.queue_depth", "must be between 1 and 4096"));
        }
        if a.thread_count == 0 || a.thread_count > 256 {
            return Err(self.invalid("aio.thread_count", "must be between 1 and 256"));
        }
        Ok(())
    }

    fn check_target(&self, key: &str, t: &OffloadSpec) -> Result<(), ConfigError> {
        if t.buffer_count == Some(0) {
            return Err(self.invalid(&format!("{key}.buffer_count"), "must be at least 1"));
        }
        if !t.is_nvme() {
            return Ok(());
        }
        match t.nvme_path.as_deref().map(str::trim) {
            None | Some("") => Err(self.invalid(
                &format!("{key}.nvme_path"),
                "is required with device: nvme (a directory on a local disk)",
            )),
            Some(_) => Ok(()),
        }
    }
}

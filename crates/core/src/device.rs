//! Where tensors live and ops run.

use crate::{Error, Result};

/// A compute device. CUDA devices carry their context and streams, so ops need no extra handle.
#[derive(Clone, Debug, Default)]
pub enum Device {
    #[default]
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaDevice),
}

/// A GPU's memory as Megatron's --log-memory-to-tensorboard reports PyTorch's: the bytes its
/// allocator holds from the driver (reserved) and has handed out (allocated), now and at their
/// highest since the process started. Here the allocator is the device's default stream-ordered
/// pool (`cuMemAllocAsync`), which every tensor comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub reserved: u64,
    pub max_reserved: u64,
    pub allocated: u64,
    pub max_allocated: u64,
}

/// Work captured from a device (`Device::capture`), replayed by `launch`.
pub enum Graph {
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DeviceGraph),
}

impl Graph {
    /// Queues one replay of the captured work.
    pub fn launch(&self) -> Result<()> {
        match *self {
            #[cfg(feature = "cuda")]
            Graph::Cuda(ref g) => g.launch(),
        }
    }

    /// Drops the graph after the work queued before it (its replays included) and gives the
    /// memory its captured allocations held back to the device (waits for that work).
    pub fn release(self) -> Result<()> {
        match self {
            #[cfg(feature = "cuda")]
            Graph::Cuda(g) => g.release(),
        }
    }
}

impl Device {
    /// Parses `cpu`, `cuda` (ordinal 0) or `cuda:N`, opening the CUDA device when asked for one.
    pub fn parse(spec: &str) -> Result<Device> {
        match spec.trim() {
            "cpu" => Ok(Device::Cpu),
            s if s == "cuda" || s.starts_with("cuda:") => {
                let ordinal = match s.strip_prefix("cuda:") {
                    None => 0,
                    Some(n) => n.parse::<usize>().map_err(|_| Error::InvalidArgument {
                        op: "Device::parse",
                        msg: format!("`{s}` is not a device; use cpu, cuda or cuda:N"),
                    })?,
                };
                Device::cuda(ordinal)
            }
            s => Err(Error::InvalidArgument {
                op: "Device::parse",
                msg: format!("`{s}` is not a device; use cpu, cuda or cuda:N"),
            }),
        }
    }

    /// Opens CUDA device `ordinal`.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        #[cfg(feature = "cuda")]
        {
            crate::cuda::CudaDevice::new(ordinal).map(Device::Cuda)
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::CudaNotBuilt { device: format!("cuda:{ordinal}") })
        }
    }

    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// The device memory pool's bytes (`MemoryStats`), or None on the CPU, which has no pool.
    pub fn memory_stats(&self) -> Result<Option<MemoryStats>> {
        match self {
            Device::Cpu => Ok(None),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.memory_stats().map(Some),
        }
    }

    /// Opens (`true`) or closes a CUDA profiler range (`CudaDevice::profiler_range`); the CPU has
    /// none, so there it does nothing.
    pub fn profiler_range(&self, on: bool) -> Result<()> {
        match self {
            Device::Cpu => {
                let _ = on;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.profiler_range(on),
        }
    }

    /// Captures the work `f` queues on this device into a graph that [`Graph::launch`] replays
    /// (`CudaDevice::capture`: what may and may not happen inside). The CPU runs ops as they are
    /// called, so it has nothing to capture: an error there.
    pub fn capture<R, E: From<Error>>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(Graph, R), E> {
        match self {
            Device::Cpu => {
                let _ = f;
                Err(Error::NotImplemented { op: "graph capture", device: self.name() }.into())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.capture(f).map(|(g, r)| (Graph::Cuda(g), r)),
        }
    }

    /// Waits until the device has finished everything queued on it (the CPU runs ops as they are
    /// called, so there it returns at once).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.synchronize(),
        }
    }

    /// Same physical device (CPU, or the same CUDA ordinal).
    pub fn same(&self, other: &Device) -> bool {
        self.name() == other.name()
    }

    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => format!("cuda:{}", d.ordinal()),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_and_rejects_garbage() {
        assert!(Device::parse("cpu").unwrap().is_cpu());
        let e = Device::parse("tpu").unwrap_err().to_string();
        assert!(e.contains("cpu, cuda or cuda:N"), "{e}");
        assert!(Device::parse("cuda:x").is_err());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_names_the_feature() {
        let e = Device::parse("cuda:1").unwrap_err().to_string();
        assert!(e.contains("--features cuda"), "{e}");
    }
}

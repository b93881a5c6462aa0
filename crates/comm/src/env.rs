//! Who this process is, from the launcher's environment variables.

use crate::{CommError, Result};

/// Rank, world size, local rank and rendezvous address of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Which launcher's variables were read (`single`, `torchrun`, `slurm`, `openmpi`).
    pub source: &'static str,
}

impl DistEnv {
    /// One process alone (no launcher).
    pub fn single() -> Self {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            source: "single",
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads from `get` (the environment, or a map in tests). torchrun's variables win over SLURM's,
    /// which win over Open MPI's; MASTER_ADDR / MASTER_PORT apply to all.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |k: &str| -> Result<Option<usize>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| CommError::Env(format!("{k}={v:?} is not a number"))),
            }
        };
        let triples: [(&'static str, [&str; 3]); 3] = [
            ("torchrun", ["RANK", "WORLD_SIZE", "LOCAL_RANK"]),
            ("slurm", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]),
            ("openmpi", ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"]),
        ];
        let mut env = DistEnv::single();
        for (source, [r, w, l]) in triples {
            if let (Some(rank), Some(world)) = (num(r)?, num(w)?) {
                env = DistEnv { rank, world_size: world, local_rank: num(l)?.unwrap_or(rank), source, ..env };
                break;
            }
        }
        if let Some(a) = get("MASTER_ADDR") {
            env.master_addr = a;
        }
        if let Some(p) = get("MASTER_PORT") {
            env.master_port =
                p.trim().parse().map_err(|_| CommError::Env(format!("MASTER_PORT={p:?} is not a port number")))?;
        }
        if env.world_size == 0 || env.rank >= env.world_size {
            return Err(CommError::Env(format!(
                "rank {} is outside world size {} ({} variables)",
                env.rank, env.world_size, env.source
            )));
        }
        Ok(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<DistEnv> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn reads_each_launcher() {
        assert_eq!(env(&[]).unwrap(), DistEnv::single());
        let t = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "6000"),
        ])
        .unwrap();
        assert_eq!(
            (t.rank, t.world_size, t.local_rank, t.master_addr.as_str(), t.master_port, t.source),
            (3, 8, 3, "10.0.0.1", 6000, "torchrun")
        );
        let s = env(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "16"), ("SLURM_LOCALID", "1")]).unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.source), (5, 16, 1, "slurm"));
        let o =
            env(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_LOCAL_RANK", "0")])
                .unwrap();
        assert_eq!((o.rank, o.world_size, o.local_rank, o.source), (2, 4, 0, "openmpi"));
        // torchrun wins when several are set (srun running torchrun).
        let both = env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]).unwrap();
        assert_eq!(both.source, "torchrun");
    }

    #[test]
    fn bad_values_are_named() {
        let e = env(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = env(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(e.contains("rank 2 is outside world size 2"), "{e}");
        assert!(env(&[("MASTER_PORT", "99999")]).is_err());
    }
}

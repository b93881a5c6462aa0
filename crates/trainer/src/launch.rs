//! `ferrotron launch --nproc-per-node N -- train …`: starts N copies of this program on this node,
//! one per GPU (or CPU rank), with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
//! MASTER_PORT, plus LOCAL_WORLD_SIZE, GROUP_RANK). Children inherit the caller's environment, so
//! NCCL_* settings (e.g. NCCL_NVLS_ENABLE=0) reach every rank. If a rank fails, the others are
//! stopped and the launcher exits with that rank's status.

use anyhow::{Context, bail};
use std::process::{Child, Command};
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Processes on this node (one per GPU).
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index among them.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// The ferrotron command each rank runs (after `--`), e.g. `train --preset 124m`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// The environment of local rank `local`.
pub fn rank_env(a: &LaunchArgs, local: usize) -> Vec<(String, String)> {
    let world = a.nnodes * a.nproc_per_node;
    let rank = a.node_rank * a.nproc_per_node + local;
    [
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string()),
        ("GROUP_RANK", a.node_rank.to_string()),
        ("MASTER_ADDR", a.master_addr.clone()),
        ("MASTER_PORT", a.master_port.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Runs the ranks of this node to completion; Ok when every one succeeded.
pub fn launch(a: &LaunchArgs) -> anyhow::Result<()> {
    if a.nproc_per_node == 0 || a.nnodes == 0 || a.node_rank >= a.nnodes {
        bail!(
            "--nproc-per-node {} / --nnodes {} / --node-rank {}: need at least one process and node, and a node rank below --nnodes",
            a.nproc_per_node,
            a.nnodes,
            a.node_rank
        );
    }
    let exe = std::env::current_exe().context("cannot find this program to start the ranks")?;
    let mut kids: Vec<(usize, Child)> = Vec::new();
    for local in 0..a.nproc_per_node {
        let child = Command::new(&exe)
            .args(&a.command)
            .envs(rank_env(a, local))
            .spawn()
            .with_context(|| format!("starting local rank {local}"));
        match child {
            Ok(c) => kids.push((local, c)),
            Err(e) => {
                stop(&mut kids);
                return Err(e);
            }
        }
    }
    loop {
        let mut running = false;
        for i in 0..kids.len() {
            let (local, k) = &mut kids[i];
            match k.try_wait()? {
                Some(st) if !st.success() => {
                    let local = *local;
                    stop(&mut kids);
                    bail!("local rank {local} failed ({st}); stopped the other ranks");
                }
                Some(_) => {}
                None => running = true,
            }
        }
        if !running {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stop(kids: &mut [(usize, Child)]) {
    for (_, k) in kids.iter_mut() {
        let _ = k.kill();
        let _ = k.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_follow_torchrun() {
        let a = LaunchArgs {
            nproc_per_node: 4,
            nnodes: 2,
            node_rank: 1,
            master_addr: "10.0.0.1".into(),
            master_port: 1234,
            command: vec!["train".into()],
        };
        let e: std::collections::HashMap<_, _> = rank_env(&a, 2).into_iter().collect();
        assert_eq!((e["RANK"].as_str(), e["LOCAL_RANK"].as_str(), e["WORLD_SIZE"].as_str()), ("6", "2", "8"));
        let env = ferrotron_comm::DistEnv::from_lookup(|k| e.get(k).cloned()).unwrap();
        assert_eq!((env.rank, env.world_size, env.local_rank, env.master_port), (6, 8, 2, 1234));
    }
}

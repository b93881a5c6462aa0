#!/usr/bin/env bash
# A device lease's checks and measurements in one command, so a short lease is spent on the GPU
# rather than on typing. Two sides:
#
#   here (with cargo):  benches/gpu_session.sh stage
#       builds the release binaries with CUDA and stages them in .gpu/ (ignore it in
#       .git/info/exclude; carry it to the GPU machine): .gpu/v/tests/{ops,cuda_train,cuda_graph,nccl}
#       (`cargo xtask gpu-test`),
#       .gpu/v/ferrotron, .gpu/v/{attention,loss,gemm}_bench, .gpu/xtask, .gpu/benches/*.py, and the
#       kernels compiled for sm_90a in .gpu/fc (examples/kernel_cache.rs, NVRTC 13.0 from PyPI).
#
#   there (repo root, no cargo):  benches/gpu_session.sh STEP...
#       verify                 the op tests, the CUDA training tests, NCCL at world size 1 and
#                              context-parallel attention on thread ranks sharing the GPU
#                              (stops at a failure: nothing is measured on a build that computes
#                              wrongly)
#       attn[:VAR=V,...]       `xtask bench --attention`: our kernels beside SDPA, with VARs set
#                              (one head dim in ATTN_BENCH_DIMS here: the VARs are comma-separated)
#       ce                     the fused cross-entropy alone (examples/loss_bench.rs), keeping the
#                              row in shared memory and (FERROTRON_CE_KEEP=0) not
#       gemm                   our GEMM kernels beside cuBLASLt on the MLP's products
#                              (examples/gemm_bench.rs)
#       trace:PRESET[:VAR=V,...]   our GPU timeline of PRESET (124m, 1.3b, llama-1b) alone
#                              (TRACE_KERNELS=N among the VARs: its N costliest kernels too;
#                              TRACE_GAPS=N: the N kernel pairs with the most idle time between)
#       matched[:PRESET,...[:VAR=V,...]]   the matched bench, Ferrotron and PyTorch (`xtask bench
#                              --gpu`), with VARs set for both (e.g. matched:124m,1.3b:FERROTRON_FLASH_DYN=0)
#       mamba[:VAR=V,...]      eight Mamba-2 layers (hidden 1024, seq 2048, bf16): Ferrotron and
#                              the PyTorch twin (benches/torch_mamba.py), with VARs set for ours
#       ncu-bwd:DxT[:VAR=V,...]    Nsight Compute on one flash backward of attention_bench's shape
#                              DxT (e.g. 64x1024): time, instructions, L2 bytes and reductions
#       ncu:REGEX:DxT[:VAR=V,...]  Nsight Compute on the first kernel matching REGEX in one
#                              attention_bench call of shape DxT: speed of light, pipe use (the
#                              MUFU's and wgmma's too), warp stall reasons
#     e.g. `verify attn attn:FERROTRON_FLASH_TMA=0 trace:124m trace:124m:FERROTRON_FLASH_BIAS_GRAD=0`.
#     Every step's output goes to the console and to $OUT/session.log (./gpu-logs without $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = stage ]; then
    set -e
    cargo build --release --features cuda -p ferrotron-trainer -p xtask -p ferrotron-examples --examples --bins
    rm -rf .gpu/v && mkdir -p .gpu/v .gpu/benches
    cargo run -q --release -p xtask -- gpu-test .gpu/v/tests
    find .gpu/v/tests -type f ! -name ops ! -name cuda_train ! -name nccl ! -name cuda_graph ! -name context_attention -delete
    cp target/release/ferrotron target/release/examples/{attention,loss,gemm}_bench .gpu/v/
    cp target/release/xtask .gpu/
    cp benches/*.py .gpu/benches/
    strip .gpu/v/ferrotron .gpu/v/{attention,loss,gemm}_bench .gpu/xtask
    # The kernels compiled here (NVRTC 13.0 from PyPI, the GPU machine's version) into .gpu/fc:
    # a fresh GPU machine then loads the CUBIN instead of compiling for about a minute.
    rm -rf .gpu/fc
    venv=target/ci-venv
    if { [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"; } && "$venv/bin/pip" install -q "nvidia-cuda-nvrtc==13.0.*"; then
        lib=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
        FERROTRON_CACHE_DIR=.gpu/fc LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            cargo run -q --release --features cuda -p ferrotron-examples --example kernel_cache -- sm_90a
    else
        echo "NVRTC 13.0 could not be installed here: the GPU machine compiles the kernels itself"
    fi
    du -sh .gpu
    exit 0
fi

[ -d .gpu/v ] || { echo "no .gpu/v here: run 'benches/gpu_session.sh stage' where cargo is, and carry .gpu"; exit 2; }
SP=$(python3 -c "import site;print(site.getsitepackages()[0])")
export LD_LIBRARY_PATH="$(ls -d "$SP"/nvidia/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}"
export FERROTRON_CACHE_DIR=${FERROTRON_CACHE_DIR:-/tmp/fc} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# The kernels staged with the binaries (`stage`), where the cache does not hold them yet.
if [ -d .gpu/fc/ptx ]; then
    mkdir -p "$FERROTRON_CACHE_DIR/ptx" && cp -n .gpu/fc/ptx/* "$FERROTRON_CACHE_DIR/ptx/" 2>/dev/null
fi
log=${OUT:-gpu-logs}/session.log  # one file: the device returns at most 8
mkdir -p "$(dirname "$log")"
status=0
for step in "$@"; do
    kind=${step%%:*}
    rest=${step#"$kind"}
    rest=${rest#:}
    vars=()
    rc=0
    echo "== $step ($(date +%T))" | tee -a "$log"
    case $kind in
        verify)
            (cd .gpu/v/tests && ./ops && ./cuda_train && ./cuda_graph && ./nccl && ./context_attention) 2>&1 | tee -a "$log" | tail -n 40
            rc=${PIPESTATUS[0]}
            if [ "$rc" -ne 0 ]; then
                echo "verify FAILED: the remaining steps are skipped" | tee -a "$log"
                exit 1
            fi
            ;;
        attn)
            [ -n "$rest" ] && IFS=, read -ra vars <<< "$rest"
            (cd .gpu && env "${vars[@]}" ./xtask bench --attention v/attention_bench) 2>&1 | tee -a "$log"
            rc=${PIPESTATUS[0]}
            ;;
        ce)
            { .gpu/v/loss_bench && FERROTRON_CE_KEEP=0 .gpu/v/loss_bench; } 2>&1 | tee -a "$log"
            rc=${PIPESTATUS[0]}
            ;;
        gemm)
            .gpu/v/gemm_bench 2>&1 | tee -a "$log"
            rc=${PIPESTATUS[0]}
            ;;
        trace)
            preset=${rest%%:*}
            more=${rest#"$preset"}
            more=${more#:}
            [ -n "$more" ] && IFS=, read -ra vars <<< "$more"
            (cd .gpu && env BENCH_TORCH=0 "${vars[@]}" ./xtask bench --gpu-trace v/ferrotron "$preset") 2>&1 | tee -a "$log"
            rc=${PIPESTATUS[0]}
            ;;
        ncu-bwd)
            shape=${rest%%:*}
            more=${rest#"$shape"}
            more=${more#:}
            [ -n "$more" ] && IFS=, read -ra vars <<< "$more"
            m=gpu__time_duration.sum,smsp__inst_executed.sum,lts__t_bytes.sum,lts__t_sectors_op_red.sum
            m=$m,lts__throughput.avg.pct_of_peak_sustained_elapsed
            (cd .gpu && env ATTN_BENCH_ONLY="$shape" ATTN_BENCH_REPS=1 "${vars[@]}" \
                ncu --kernel-name regex:flash_bwd_dkvq --launch-count 1 --metrics "$m" v/attention_bench) 2>&1 | tee -a "$log"
            rc=${PIPESTATUS[0]}
            ;;
        ncu)
            # ncu:REGEX:DxT[:VARS]: the first kernel matching REGEX in one attention_bench call of
            # shape DxT, with where its time goes (SOL, pipes incl. the MUFU, warp stall reasons);
            # clocks left alone, as the device notes ask.
            re=${rest%%:*}
            more=${rest#"$re"}
            more=${more#:}
            shape=${more%%:*}
            more=${more#"$shape"}
            more=${more#:}
            [ -n "$more" ] && IFS=, read -ra vars <<< "$more"
            (cd .gpu && env ATTN_BENCH_ONLY="$shape" ATTN_BENCH_REPS=1 "${vars[@]}" \
                ncu --clock-control none --kernel-name "regex:$re" --launch-count 1 --section SpeedOfLight \
                --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats \
                --metrics sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
                v/attention_bench) 2>&1 | tee -a "$log"
            rc=${PIPESTATUS[0]}
            ;;
        matched)
            list=${rest%%:*}
            more=${rest#"$list"}
            more=${more#:}
            [ -n "$more" ] && IFS=, read -ra vars <<< "$more"
            IFS=, read -ra presets <<< "${list:-124m,1.3b,llama-1b}"
            (cd .gpu && env "${vars[@]}" ./xtask bench --gpu v/ferrotron "${presets[@]}") 2>&1 | tee -a "$log"
            rc=${PIPESTATUS[0]}
            ;;
        mamba)
            # Eight Mamba-2 layers (hidden 1024, 32 heads of 64, 8 groups of 128 state channels),
            # seq 2048, micro-batch 4, bf16: Ferrotron (30 steps; the last 10's tokens/s) and the
            # PyTorch twin (benches/torch_mamba.py) at the FLOPs per token Ferrotron prints.
            [ -n "$rest" ] && IFS=, read -ra vars <<< "$rest"
            m=(--preset mamba-tiny --device cuda --bf16 --hybrid-layer-pattern MMMMMMMM --hidden-size 1024
               --mamba-head-dim 64 --mamba-state-dim 128 --mamba-num-groups 8 --seq-length 2048
               --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 4 --train-iters 30
               --log-interval 10 --eval-iters 0)
            env "${vars[@]}" .gpu/v/ferrotron train "${m[@]}" > "$log.mamba" 2>&1
            rc=$?
            grep -E "parameters|iteration" "$log.mamba" | tee -a "$log"
            f=$(grep -o "[0-9.]* MFLOP/token" "$log.mamba" | head -1 | cut -d' ' -f1)
            if [ "$rc" -eq 0 ] && [ -n "$f" ]; then
                python3 .gpu/benches/torch_mamba.py --flops-per-token "${f}e6" 2>&1 | tail -1 | tee -a "$log"
                rc=${PIPESTATUS[0]}
            fi
            ;;
        *)
            echo "unknown step '$step' (verify, attn[:VARS], trace:PRESET[:VARS], matched[:PRESETS[:VARS]], mamba[:VARS], ncu-bwd:DxT[:VARS], ncu:REGEX:DxT[:VARS])" | tee -a "$log"
            rc=2
            ;;
    esac
    [ "$rc" -ne 0 ] && status=$rc
done
exit $status

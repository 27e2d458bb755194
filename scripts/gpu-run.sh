#!/usr/bin/env bash
# Runs on a lent GPU machine (see scripts/gpu-bundle.sh, which builds what it runs): one stage per call, so that
# every call stays inside its limit, with logs and JSON in $OUT/gpu-run.tgz and a short summary printed last.
#   parity   the kernels' GPU-CPU parity tests and the runner tests (synthetic model; SmolLM2 once `model` ran)
#   smollm2  the runner tests that need SmolLM2 (after `model`)
#   model    joins target/gpu-bundle/model.part* (sent in separate calls) into models/ once all have arrived, and
#            checks the sha256 that model.sha256 holds (its second line: the number of parts)
#   kernels  pagoda bench kernels --device cuda (decode-attention bandwidth per codec, batch 1-64, 1K-32K)
#   engine   pagoda bench engine, GPU against this machine's CPU: SmolLM2 (real when present, else its synthetic
#            shape) at 1, 8 and 32 sequences (32 three times on each side, for a median), and the synthetic
#            llama-1b and llama-8b on the GPU
#   profile  the engine bench with the GPU forward's per-step timings (debug log)
#   eviction pagoda bench eviction --device cuda at the eviction issue's load (needs the model: run `model` first):
#            full cache and PagedEviction at budgets 256 and 1024
#   peers    two GPU workers and a round-robin router (scripts/gpu-peers.py, needs the model): prefixes pulled
#            between them answer exactly as computed; the NCCL link bootstrap over Transfer.OpenLink runs, and on
#            one GPU its refusal is counted (with two GPUs, the second worker takes the second and pulls must use
#            the link)
# Usage (device machine, repository root): bash scripts/gpu-run.sh STAGE...
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=target/gpu-bundle
bin=$bundle/bin
# Logs and JSON gather here and leave as one archive in $OUT: a call brings back at most 8 files.
out=$bundle/out
rm -rf "$out"
mkdir -p "$out" "$bin"
# Python's lzma stands in where the image has no xz.
unxz() { if command -v xz > /dev/null; then xz -dc; else python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)'; fi; }
if [ -f "$bundle/bin.tar.xz" ] && [ "$bundle/bin.tar.xz" -nt "$bin/.unpacked" ]; then
  unxz < "$bundle/bin.tar.xz" | tar -C "$bin" -xf - && touch "$bin/.unpacked"
fi
# cudarc loads libcuda from the driver and libnvrtc, libcublas and libnccl by name: the image ships them in its
# Python wheels (nvidia-*).
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
if [ -n "$site" ] && [ -d "$site/nvidia" ]; then
  libs=$(find "$site/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# cudarc asks for libnccl.so or libnccl.so.<CUDA major>, and the wheel ships libnccl.so.2 only.
mkdir -p "$bundle/libs"
nccl=$(find "${site:-/nonexistent}/nvidia" -name 'libnccl.so.2' 2>/dev/null | head -n1)
[ -n "$nccl" ] && ln -sf "$nccl" "$bundle/libs/libnccl.so"
export LD_LIBRARY_PATH="$PWD/$bundle/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PAGODA_CUDA_CACHE=$bundle/ptx-cache
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
summary=()

stage() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc $rc, $((SECONDS - t0)) s")
  return $rc
}

for s in "$@"; do
  case $s in
    parity)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/device.txt" 2>&1
      { echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; ls "$bin"; } > "$out/env.txt"
      stage cuda_parity 90 "$bin/cuda_parity" --test-threads=1 --nocapture
      stage cuda_model 100 env PAGODA_MODEL="$PWD/$model" "$bin/cuda_model" --test-threads=1 --nocapture
      grep -h "^parity\|skipped\|^test result\|FAILED\|panicked" "$out"/cuda_parity.log "$out"/cuda_model.log
      ;;
    peers)
      second=0
      [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ] && second=1
      stage peers 120 python3 scripts/gpu-peers.py --bin "$bin/pagoda" --model "$PWD/$model" --device cuda \
        --second-ordinal "$second"
      tail -n 12 "$out/peers.log"
      ;;
    smollm2)
      stage cuda_model_smollm2 60 env PAGODA_MODEL="$PWD/$model" "$bin/cuda_model" --test-threads=1 --nocapture smollm2
      grep -h "skipped\|^test result\|FAILED\|panicked\|top-2" "$out"/cuda_model_smollm2.log
      ;;
    model)
      want=$(sed -n 2p "$bundle/model.sha256" 2>/dev/null)
      have=$(find "$bundle" -maxdepth 1 -name 'model.part*' | wc -l)
      if [ -f "$model" ]; then
        summary+=("model: present")
      elif [ -n "$want" ] && [ "$have" -eq "$want" ]; then
        mkdir -p models
        cat "$bundle"/model.part* | unxz > "$model"
        if [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$(sed -n 1p "$bundle/model.sha256")" ]; then
          summary+=("model: joined $have parts, sha256 ok")
        else
          rm -f "$model"
          summary+=("model: sha256 mismatch, removed")
        fi
      else
        summary+=("model: $have of ${want:-?} parts here")
      fi
      ;;
    kernels)
      stage bench_kernels 80 "$bin/pagoda" bench kernels --device cuda --budget-ms 200 \
        --json "$out/bench-kernels-cuda.json"
      tail -n 30 "$out/bench_kernels.log"
      ;;
    engine)
      smol=(--model "$model")
      [ -f "$model" ] || smol=(--synthetic-model smollm2-135m)
      stage engine_smollm2_cuda 40 env RUST_LOG=info,pagoda_worker::model::cuda=debug \
        "$bin/pagoda" bench engine --device cuda "${smol[@]}" --concurrency 1,8,32,32,32 \
        --decode-new-tokens 64 --json "$out/bench-engine-smollm2-cuda.json"
      stage engine_smollm2_cpu 60 "$bin/pagoda" bench engine --threads 0 "${smol[@]}" --concurrency 32,32,32 \
        --decode-new-tokens 32 --json "$out/bench-engine-smollm2-cpu.json"
      stage engine_llama1b_cuda 35 "$bin/pagoda" bench engine --device cuda --synthetic-model llama-1b \
        --concurrency 1,8,32 --decode-new-tokens 32 --json "$out/bench-engine-llama1b-cuda.json"
      stage engine_llama8b_cuda 50 "$bin/pagoda" bench engine --device cuda --synthetic-model llama-8b \
        --concurrency 1,8,32 --decode-new-tokens 16 --json "$out/bench-engine-llama8b-cuda.json"
      grep -h -i "decode\|prefill\|synthetic" "$out"/engine_*.log | head -n 40
      ;;
    profile)
      # Where a decode step's time goes on the GPU (host enqueue, GPU wait, logits copy), per step, in the log.
      stage profile_smollm2 60 env RUST_LOG=pagoda_worker::model::cuda=debug "$bin/pagoda" bench engine --device cuda \
        --synthetic-model smollm2-135m --concurrency 1,32 --decode-new-tokens 32 \
        --json "$out/bench-engine-profile.json"
      grep -h "decode |" "$out/profile_smollm2.log"
      ;;
    eviction)
      if [ -f "$model" ]; then
        stage bench_eviction_cuda 120 "$bin/pagoda" bench eviction --device cuda --model "$model" --requests 64 \
          --policies full,paged_eviction --budgets 256,1024 --json "$out/bench-eviction-cuda.json"
        tail -n 12 "$out/bench_eviction_cuda.log"
      else
        summary+=("eviction: no model yet (send its parts and run the model stage)")
      fi
      ;;
    *)
      echo "unknown stage $s (parity, smollm2, model, kernels, engine, profile, eviction, peers)" >&2
      exit 2
      ;;
  esac
done
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
[ -n "${OUT:-}" ] && tar -C "$out" -czf "$OUT/gpu-run.tgz" .

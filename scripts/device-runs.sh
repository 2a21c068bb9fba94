#!/usr/bin/env bash
# The GPU runs the open issues still owe, grouped so that each group fits one device call (10 minutes),
# run on the lent machine from the repository root:
#   here:   bash scripts/device-wheels.sh && mkdir -p .mortal && cp -r ../shared/anchors/assets .mortal/assets
#   device: run(command="bash scripts/device-runs.sh GROUP", kind="nvidia-h200-x2",
#               carry=[".whl", ".mortal/assets"])
# Each bench writes $OUT/NAME.json (and, when it fails, $OUT/logs-NAME.tgz with mortal's worker logs), the learning
# bench's calls one archive $OUT/learning.tgz (pack_learning); every bench's whole output is appended to
# $OUT/all.log. A machine idle for 30 s is given back: start the next group's call as soon as one returns. Copy
# what comes back into bench/results/ under names that say the device and the run, and record it in
# docs/benchmarks.md.
set -uo pipefail
group=${1:?"a group: two-gpus, two-gpus-ddp, two-gpus-ddp-onpolicy, kernels-doorbells, two-gpus-kept, two-gpus-trl, two-gpus-ddp-trl, profile, profile-onegpu, profile-ddp, seven-b, seven-b-mortal, seven-b-trl, seven-b-offload, seven-b-lora, seven-b-lora-overlap, seven-b-lora-pair, seven-b-lora-pair2, gpu-tests, gpu-tests-unrun, ddp-tests, nccl-three, offload, fused-loss, seven-b-full-one, regional, decoder-tests, regional-profile, scope-step, mfu-split, mfu-shift, compile-layer, layer-trl, shift-ab, profile-layer, learning-layer, carry, learning-trl-start, learning-finish, learning-mortal-st1, learning-seeds-start, learning-seeds-finish, learning-seeds-more, learning-seeds-last, headstart, headstart-step, headstart-tests, learning-headstart, learning-x4-start, learning-x4-finish, learning-x4-more, learning-tf32-start, learning-tf32-finish, learning-tf32-last, learning-tf32-more, learning-tf32-again, learning-tf32-again-finish, oom-test, learning-tf32-x2-trl, learning-tf32-x2-mortal, learning-tf32-x2-st1, learning-one-trl, learning-one-mortal, learning-one-more, learning-x4-wait, learning-seeds-wait, heal-1.5b, heal-3b, heal-7b-lora"}
source scripts/device-setup.sh  # leaves the shell in /tmp with R set to the repository root
nvidia-smi -L | tee "$OUT/env.log"
python3 -c "import torch, transformers, trl; print(torch.__version__, transformers.__version__, trl.__version__)" | tee -a "$OUT/env.log"
started=$(date +%s)
MORTAL_GPU_BASE=0  # the learning groups: mortal's seed N on GPU MORTAL_GPU_BASE + N % LEARNING_GPUS (TRL's on GPU
LEARNING_GPUS=2    # N % LEARNING_GPUS); 1 on a machine of one GPU
LEARNING_FLAGS=""  # the learning groups: flags for both sides' bench/learning_gpu.py (--tf32), and the suffix
LEARNING_TAG=""    # their JSONs' names get (_tf32), so that runs of two settings are never mistaken for each other

# bench NAME LIMIT_SECONDS ARGS...: bench/gpu_step.py ARGS under a time limit (SIGTERM: it saves what it measured)
bench() {
  local name=$1 limit=$2 began rc
  shift 2
  began=$(date +%s)
  echo "== $name at $((began - started)) s: $*"
  timeout -s TERM -k 30 "$limit" python3 "$R/bench/gpu_step.py" --json "$OUT/$name.json" --logs "/tmp/logs-$name" "$@" \
    > "/tmp/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - began )) s"
  grep -E "s/step|busy|peak|mortal / TRL|weight sync|limits|memory choices|Error|Traceback" "/tmp/$name.log" | tail -12
  cat "/tmp/$name.log" >> "$OUT/all.log"
  [ "$rc" = 0 ] || tar czf "$OUT/logs-$name.tgz" -C /tmp "logs-$name" "$name.log" 2>/dev/null
}

# train_step NAME LIMIT_SECONDS ARGS...: bench/train_step.py ARGS (TRL's training step alone, each --loss in turn in
# one process) under a time limit; its JSON is $OUT/NAME.json
train_step() {
  local name=$1 limit=$2 began rc
  shift 2
  began=$(date +%s)
  echo "== $name at $((began - started)) s: $*"
  timeout -k 10 "$limit" python3 "$R/bench/train_step.py" --json "$OUT/$name.json" "$@" > "/tmp/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - began )) s"
  grep -E "median step|out of GPU memory|Error|Traceback" "/tmp/$name.log" | tail -8
  cat "/tmp/$name.log" >> "$OUT/all.log"
}

# gpu_tests LIMIT_SECONDS PYTEST_ARGS...: GPU-marked tests under a time limit; their temporary folders (worker
# logs) come back as gpu-tests-logs.tgz
gpu_tests() {
  local limit=$1
  shift
  timeout -k 10 "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu --basetemp=/tmp/pt "$@" 2>&1 \
    | tee -a "$OUT/gpu-tests.log"
  tar czf "$OUT/gpu-tests-logs.tgz" -C /tmp pt 2>/dev/null
}

# keep_profiles: the profiled benches' tables and traces (mortal.workers.step_profile) come back as two archives
keep_profiles() {
  (cd /tmp && tar czf "$OUT/profile-tables.tgz" logs-profile_*/profile-*.txt \
     && tar czf "$OUT/profile-traces.tgz" logs-profile_*/profile-*.json.gz)
}

# learning_mortal STALENESS LIMIT_SECONDS [SEEDS] [--shares-gpu]: mortal's side of the learning bench, all SEEDS
# (default "0 1") at once, seed N on GPU MORTAL_GPU_BASE + N % LEARNING_GPUS
learning_mortal() {
  local staleness=$1 limit=$2 seeds=${3:-0 1} shared=${4:-} seed pids=""
  [ -f /root/smol.gguf ] || { echo "no /root/smol.gguf" >&2; return 2; }
  for seed in $seeds; do
    CUDA_VISIBLE_DEVICES=$((MORTAL_GPU_BASE + seed % LEARNING_GPUS)) timeout -k 10 "$limit" python3 "$R/bench/learning_gpu.py" --model /root/smol.gguf \
      --only mortal --seed $seed --staleness "$staleness" $shared $LEARNING_FLAGS --logs "/tmp/logs-learning-s$seed-st$staleness" \
      --json "$LEARNING_RESULTS/learning_gpu_mortal_s${seed}_st${staleness}${LEARNING_TAG}.json" > "/tmp/learning-s$seed-st$staleness.log" 2>&1 &
    pids="$pids $!"
  done
  # these runs only: a bare `wait` also waited for start_trl's TRL processes of the same call (about 10 minutes),
  # which is why learning-x4-start and learning-tf32-start ran out before their second pair of seeds
  wait $pids
  for seed in $seeds; do
    echo "== mortal seed $seed, maxStaleness $staleness"; tail -3 "/tmp/learning-s$seed-st$staleness.log"
    cat "/tmp/learning-s$seed-st$staleness.log" >> "$OUT/all.log"
  done
  pack_learning
}

# learning_alone STALENESS LIMIT_SECONDS CALL_SECONDS SEEDS: mortal's runs one after another, each alone on GPU 0 of
# a machine of one GPU, each begun only while LIMIT_SECONDS still fit before CALL_SECONDS from the call's start (a
# seed left out says so; the next call runs it)
learning_alone() {
  local staleness=$1 limit=$2 call=$3 seeds=$4 seed
  for seed in $seeds; do
    if [ $(( $(date +%s) - started + limit )) -gt "$call" ]; then
      echo "== mortal seed $seed, maxStaleness $staleness: left for the next call ($(( $(date +%s) - started )) s into this one)"
      continue
    fi
    LEARNING_GPUS=1 learning_mortal "$staleness" "$limit" "$seed"
  done
}

# The learning calls' JSONs (mortal's and TRL's) and logs, kept on the machine across calls in LEARNING_RESULTS and
# the logs-learning-* folders, come back as one archive, $OUT/learning.tgz, rewritten after each round: a call
# returns at most 8 files (2026-11-28: with loose JSONs, TRL's seed-3 JSON and logs were left out), and a call cut
# off by its time limit still returns the rounds done. The worker logs give the start's timeline (launch, imports,
# model load, decode preparation); step profiles are left out.
LEARNING_RESULTS=/tmp/learning-results
mkdir -p "$LEARNING_RESULTS"
pack_learning() {
  (cd /tmp && tar czf "$OUT/learning.tgz" --exclude='profile-*' learning-results logs-learning-* 2>/dev/null)
}

# start_trl SEEDS [--shares-gpu]: TRL's side of the learning bench, each seed a process on GPU seed % LEARNING_GPUS that
# outlives this call (setsid; TRL's 200 steps take 12 minutes alone), run from its own copy of the installed
# packages and the bench (the next call reinstalls /tmp/site); each writes /root/learn/trl_sSEED.json at its end
start_trl() {
  local seeds=$1 shared=${2:-} seed
  [ -f /root/smol.gguf ] || { echo "no /root/smol.gguf: the calls before carry .mortal/p1 and p2" >&2; exit 2; }
  # once a machine: a later start_trl must not pull the packages or the bench from under runs still going
  [ -d /root/learn/bench ] || { mkdir -p /root/learn && cp -r /tmp/site /root/learn/site && cp -r "$R/bench" /root/learn/bench; }
  # the GGUF's float32 folder once, before two processes would both convert it (models.convert_gguf locks anyway)
  python3 -c "import sys; sys.path.insert(0, '/root/learn/bench'); from learning_gpu import local_model; from pathlib import Path; print(local_model(Path('/root/smol.gguf')))"
  for seed in $seeds; do
    CUDA_VISIBLE_DEVICES=$((seed % LEARNING_GPUS)) OMP_NUM_THREADS=4 PYTHONPATH=/root/learn/site setsid nohup python3 \
      /root/learn/bench/learning_gpu.py --model /root/smol.gguf --only trl --seed $seed $shared $LEARNING_FLAGS \
      --json /root/learn/trl_s$seed$LEARNING_TAG.json > /root/learn/trl_s$seed$LEARNING_TAG.log 2>&1 < /dev/null &
  done
  sleep 5
}

# wait_trl SEEDS LIMIT_SECONDS: until every seed's JSON is written (exit 3 when not), then both files to $OUT
wait_trl() {
  local seeds=$1 limit=$2 seed files=""
  for seed in $seeds; do files="$files /root/learn/trl_s$seed$LEARNING_TAG.json"; done
  timeout "$limit" bash -c "until ls $files > /dev/null 2>&1; do sleep 5; done"
  local rc=$?
  for seed in $seeds; do
    echo "== TRL seed $seed"; grep -c "" /root/learn/trl_s$seed$LEARNING_TAG.log; tail -2 /root/learn/trl_s$seed$LEARNING_TAG.log | cut -c1-300
    cp /root/learn/trl_s$seed$LEARNING_TAG.json /root/learn/trl_s$seed$LEARNING_TAG.log "$LEARNING_RESULTS/" 2>/dev/null
  done
  pack_learning
  [ "$rc" = 0 ] || { echo "TRL's runs did not finish in $limit s (or the machine was a fresh one: /root/learn is gone)" >&2; exit 3; }
}

case $group in
  two-gpus)  # issue 15.2: two GPUs' tokens/s against one GPU's, on-policy and overlapped (each twice in turn)
    bench onegpu 170 --steps 6 --rollouts 1 --only mortal
    bench hybrid_s0 200 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --only mortal
    bench hybrid_s1 180 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --staleness 1 --only mortal ;;
  two-gpus-kept)  # issue 15.2: the same, each layer's gathered weights kept from forward to backward
                  # (actor.reshardAfterForward false: half the all-gathers), against one GPU in the same call
    bench onegpu 170 --steps 6 --rollouts 1 --only mortal
    bench kept_s0 200 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --keep-gathered --only mortal
    bench kept_s1 180 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --keep-gathered --staleness 1 --only mortal ;;
  two-gpus-ddp)  # issue 15.2: the same with the actor replicated on both GPUs (actor.strategy ddp: no
                 # per-layer gathers, a publish from rank 0's own copy), against one GPU in the same call
    bench onegpu 170 --steps 6 --rollouts 1 --only mortal
    bench ddp_s0 200 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --strategy ddp --only mortal
    bench ddp_s1 180 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --strategy ddp --staleness 1 --only mortal ;;
  two-gpus-ddp-onpolicy)  # two-gpus-ddp's on-policy half alone (a call with under 8 minutes of device time left)
    bench onegpu 170 --steps 6 --rollouts 1 --only mortal
    bench ddp_s0 200 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --strategy ddp --only mortal ;;
  kernels-doorbells)  # one GPU's step with the doorbells (2026-11-28; before: 0.60-0.63 s on H200s); maxStaleness 1 on
                     # one GPU without and with actor.liger (less GPU time where training shares the GPU with
                     # generation); Liger's GPU test (two runs through the controller): carry [".whl", ".mortal/assets"]
                     # (ddp on-policy with the doorbells and without the buffer broadcast: two-gpus-ddp-onpolicy)
    bench onegpu 170 --steps 6 --rollouts 1 --only mortal
    bench onegpu_st1 170 --steps 6 --rollouts 1 --staleness 1 --only mortal
    bench onegpu_st1_liger 170 --steps 6 --rollouts 1 --staleness 1 --only mortal --liger mortal
    gpu_tests 200 "$R/tests/workers/test_gpu.py" -k liger ;;
  two-gpus-trl)  # issue 15.2, against TRL: the hybrid layout on-policy and TRL's GRPOTrainer with FSDP2 on the same
                 # two GPUs, in one invocation (TRL: about 14 s a step at this shape)
    bench hybrid_trl 560 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 ;;
  two-gpus-ddp-trl)  # issue 15.2, against TRL: the replicated layout on-policy and TRL's GRPOTrainer with DDP (accelerate's,
                     # as TRL runs on several GPUs without fsdp) on the same two GPUs, in one invocation
    bench ddp_trl 560 --steps 6 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --strategy ddp ;;
  profile)  # issue 15.2: where the sharded actor's training step loses 0.07-0.11 s against one GPU's: step 4
             # profiled on every rank (mortal.workers.step_profile), one GPU and the hybrid layout
    bench profile_onegpu 170 --steps 5 --rollouts 1 --only mortal --profile-steps 4
    bench profile_hybrid 200 --steps 5 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --only mortal --profile-steps 4
    keep_profiles ;;
  # The 7B groups need two H200s: call run(..., needs_h200=True). On two H100s the actor's half of the bf16
  # weights, gradients and AdamW state, the rollout and the ring do not fit 80 GB (the bench refuses it at
  # once, as mortalctl apply does; docs/benchmarks.md, 2026-11-27).
  profile-onegpu)  # the one-GPU step profiled, as profile-ddp's baseline on the same kind of GPU
    bench profile_onegpu 170 --steps 5 --rollouts 1 --only mortal --profile-steps 4
    keep_profiles ;;
  profile-ddp)  # issue 15.2: where the replicated actor's training pass loses 0.03-0.05 s against one GPU's (two H200s,
                # 2026-11-28: 0.23-0.25 s against 0.20-0.22): step 4 profiled on both ranks
    bench profile_ddp 240 --steps 5 --gpus 2 --actor-gpus 2 --rollouts 2 --prompts 16 --strategy ddp --only mortal \
      --profile-steps 4
    keep_profiles ;;
  seven-b)  # issue 19: the 7B shape, full fine-tune, over two GPUs; TRL with FSDP2 in the same invocation
    bench sevenb 570 --steps 4 --gpus 2 --actor-gpus 2 --rollouts 2 --shape 7b --micro-batch 8 ;;
  seven-b-mortal)  # the same, mortal's side alone (when TRL's does not fit the call beside it)
    bench sevenb_mortal 570 --steps 4 --gpus 2 --actor-gpus 2 --rollouts 2 --shape 7b --micro-batch 8 --only mortal ;;
  seven-b-trl)
    bench sevenb_trl 570 --steps 4 --gpus 2 --actor-gpus 2 --rollouts 2 --shape 7b --micro-batch 8 --only trl ;;
  seven-b-offload)  # issue 19: the 7B shape's full fine-tune on two H100s, which without actor.cpuOffload does not fit
                   # 80 GB (refused before launch): both sides with their shards, gradients and AdamW state in host
                   # memory; run(..., kind="nvidia-h100-x2"), carry [".whl", ".mortal/assets"]. mortal's ring of 2
                   # (sync.keepVersions): with 3, rank 0's GPU holds 15 + 45 GB of rollout and snapshots before any
                   # activation, KV cache or gathered layer (mortalctl apply's bound, 61 GB of 80)
    bench sevenb_offload 570 --steps 4 --gpus 2 --actor-gpus 2 --rollouts 2 --shape 7b --micro-batch 8 --cpu-offload \
      --keep-versions 2 ;;
  seven-b-lora)  # issue 15.1: 7B LoRA on one GPU against TRL, now that the adapters travel through the ipc ring
    bench sevenb_lora 560 --shape 7b --lora 16 --micro-batch 8 --steps 4 ;;
  seven-b-lora-overlap)  # issue 15.1: the same with maxStaleness 1 on mortal's side (generation of step s+1 beside
                         # the training of step s: 1.9 s and 1.9-2.1 s on-policy, one after the other), TRL as ever
    bench sevenb_lora_st1 570 --shape 7b --lora 16 --micro-batch 8 --steps 4 --staleness 1 ;;
  seven-b-lora-pair)  # issue 15.1 on one GPU (nvidia-h200 when no H100 is lent): on-policy beside TRL (the adapters
                      # through the ipc ring since 2026-11-27), then mortal's side alone with maxStaleness 1 against
                      # the same TRL figure; about 4 min a bench (2026-11-25: TRL 15-18 s a step, mortal 4.3)
    bench sevenb_lora_st0 330 --shape 7b --lora 16 --micro-batch 8 --steps 4
    bench sevenb_lora_st1_mortal 220 --shape 7b --lora 16 --micro-batch 8 --steps 4 --staleness 1 --only mortal ;;
  seven-b-lora-pair2)  # the second invocation of the pair, the other way round: TRL beside maxStaleness 1 first
    bench sevenb_lora_st1 330 --shape 7b --lora 16 --micro-batch 8 --steps 4 --staleness 1
    bench sevenb_lora_st0_mortal 220 --shape 7b --lora 16 --micro-batch 8 --steps 4 --only mortal ;;
  gpu-tests)  # the sharded actor's and the mixed layout's GPU tests (skipped on CPU)
    gpu_tests 560 -x "$R/tests/workers/actor/test_actor_sharded.py" "$R/tests/workers/sync/test_ipc.py" ;;
  ddp-tests)  # the replicated actor's GPU test (ipc-ddp: its first step equals the unsharded one's, rollouts beside it),
              # after rank 0 publishes alone and the gradients became views of DDP's buckets (2026-11-28)
    gpu_tests 300 "$R/tests/workers/actor/test_actor_sharded.py" -k "ddp" ;;
  nccl-three)  # issue 19: sync nccl from a sharded actor on GPUs (its rollout needs a GPU of its own, the third; it
               # skips on two): run(..., kind="nvidia-h100-x4") (or nvidia-h200-x4), carry [".whl", ".mortal/assets"]
    gpu_tests 300 "$R/tests/workers/actor/test_actor_sharded.py" -k "nccl" ;;
  gpu-tests-unrun)  # the GPU case not yet run on a GPU: LoRA's adapters through the ipc ring (the ddp and volume
                    # cases passed on two H100s on 2026-11-27; cpuOffload is the offload group)
    gpu_tests 300 "$R/tests/workers/sync/test_ipc.py" -k "colocated-ipc-True" ;;
  regional)  # issue 14 parts 1 and 3: StaticDecoder's compile scopes, the whole model against one graph for every
             # decoder layer (bench/regional_compile.py), the 0.5B shape's 24 layers twice and SmolLM2's 30 once;
             # one GPU is enough. About 8 min on an H100 (2026-11-28: 24 layers 1.8 min a run, 30 layers 3 min)
    for layers in 24 24 30; do
      timeout -k 10 240 python3 "$R/bench/regional_compile.py" --layers $layers \
        --json "$OUT/regional_compile_${layers}l_$(date +%s).json" 2>&1 | tee -a "$OUT/all.log"
    done ;;
  decoder-tests)  # the decoder's GPU tests with every compile scope (tests/workers/rollout/engines/test_static_decode.py)
    gpu_tests 300 "$R/tests/workers/rollout/engines/test_static_decode.py" ;;
  scope-step)  # issue 14 part 4 with the default compile scope (auto: layer, since 2026-11-28): the forced-256
               # bench beside TRL at the defaults, then mortal's side with the whole model compiled, in one call
               # (decode ms a step and the start of each; about 7 min on an H100)
    bench onegpu_auto 300 --steps 6 --rollouts 1
    bench onegpu_model 170 --steps 6 --rollouts 1 --only mortal --compile-scope model ;;
  mfu-split)  # issue 14 part 4: where the compiled actor's 0.18-0.20 s step goes against the Trainer's 0.116 s of
              # forward and backward: TRL's preparation of the batch (actor/prepare_seconds) against the update
              # (actor/update_seconds: forward, loss, backward, clipping, the optimizer's step), and the update's MFU
              # beside the whole step's (2026-11-28). Beside TRL with --compile both, then mortal's eager actor
              # alone: [".whl", ".mortal/assets"], one H100 (the target's GPU) or one H200
    bench mfu_compile 420 --steps 8 --rollouts 1 --compile both
    bench mfu_eager 170 --steps 8 --rollouts 1 --only mortal ;;
  mfu-shift)  # issue 14 part 4 after workers/padding_shift (2026-11-29: one H200 run gave the compiled update 0.118 s,
              # 35.4%; its GPU test failed unread): the test with its whole message, then mortal's compiled and eager
              # actor alone as in mfu-split's runs (about 7 min on an H200): [".whl", ".mortal/assets"], one H100
              # (the target's GPU) or one H200; run it twice for the lower of two
    gpu_tests 120 -x "$R/tests/workers/actor/test_padding_shift.py"
    # TORCH_LOGS=recompiles: the compiled actor compiled at steps 1 and 2 (80 s, then 120 s; 2026-11-29); with
    # dynamic shapes from the first compile (trl_seam.compile_settings, since) it should compile once
    TORCH_LOGS=recompiles bench mfu_shift_compiled 290 --steps 7 --rollouts 1 --only mortal --compile both
    tar czf "$OUT/logs-mfu_shift_compiled.tgz" -C /tmp logs-mfu_shift_compiled 2>/dev/null
    bench mfu_shift_eager 100 --steps 7 --rollouts 1 --only mortal ;;
  compile-layer)  # actor.compileScope layer (2026-11-29, CPU-tested only): each decoder layer compiled on its own
                  # (accelerate's regional compilation), so the start compiles a layer: its steps 1-2 and its update
                  # MFU against mfu-shift's compiled run (the whole model); [".whl", ".mortal/assets"], one GPU
    TORCH_LOGS=recompiles bench compile_layer 290 --steps 7 --rollouts 1 --only mortal --compile both \
      --actor-compile-scope layer
    tar czf "$OUT/logs-compile_layer.tgz" -C /tmp logs-compile_layer 2>/dev/null ;;
  layer-trl)  # issue 14 part 4 with actor.compileScope layer (2026-11-29: update MFU 39.1% / 38.1% on an H200, mortal
              # alone): the forced-256 bench beside TRL (eager, its defaults) in one invocation, mortal's actor
              # compiled a layer at a time; [".whl", ".mortal/assets"], one GPU; run it twice for the lower
    TORCH_LOGS=recompiles bench layer_trl 420 --steps 7 --rollouts 1 --compile mortal --actor-compile-scope layer
    tar czf "$OUT/logs-layer_trl.tgz" -C /tmp logs-layer_trl 2>/dev/null ;;
  shift-ab)  # workers/padding_shift against TRL's masked forward, in one invocation, alternating (off, on, off, on),
             # the actor compiled a layer at a time; first the shift's GPU test (its premise rewritten 2026-11-29:
             # eager SDPA on an H200 gave the masked forward cuDNN's kernel too); [".whl", ".mortal/assets"], one GPU
    gpu_tests 120 -x "$R/tests/workers/actor/test_padding_shift.py"
    for run in 1 2; do
      bench shift_off_run$run 150 --steps 6 --rollouts 1 --only mortal --compile both --actor-compile-scope layer \
        --no-padding-shift
      bench shift_on_run$run 150 --steps 6 --rollouts 1 --only mortal --compile both --actor-compile-scope layer
    done ;;
  profile-layer)  # where the layer-compiled step's 0.121-0.133 s go (2026-11-29: update 0.106-0.111 s, TRL's preparation
                  # 14-20 ms; the whole step's MFU 31.5-35.0% against 35%): step 5 profiled, every table in the logs
    bench profile_layer 200 --steps 7 --rollouts 1 --only mortal --compile both --profile-steps 5
    tar czf "$OUT/logs-profile_layer.tgz" -C /tmp logs-profile_layer 2>/dev/null ;;
  regional-profile)  # where the layer scope's decode step loses 0.4-0.5 ms against the whole model's (H200,
                     # 2026-11-28): each scope's kernels for one generate of the first shape (about 3 min)
    timeout -k 10 300 python3 "$R/bench/regional_compile.py" --layers 24 --profile --top 30 \
      --json "$OUT/regional_compile_24l_profile.json" 2>&1 | tee -a "$OUT/all.log" ;;
  learning-layer)  # issue 14 part 1: mortal's side of the learning bench with generation.compileScope layer (a third
                   # of the start's compile), on-policy, both seeds (ran on an H100, 2026-11-28: 170-172 s each);
                   # needs /root/smol.gguf: the two calls before this one on the same machine carry .mortal/p1 and
                   # .mortal/p2 (any groups: regional-profile, regional), this one [".mortal/p3"] (scripts/device-gguf.sh).
                   # On nvidia-h100-x1: TRL's side of this bench ran on an H100 (2026-11-24) and is too long to
                   # run beside it (719 s); report with bench/learning_gpu.py --report (docs/benchmarks.md)
    [ -f /root/smol.gguf ] || { echo "no /root/smol.gguf: carry .mortal/p1, p2, p3 in this call and the two before" >&2; exit 2; }
    for seed in 0 1; do
      timeout -k 10 280 python3 "$R/bench/learning_gpu.py" --model /root/smol.gguf --only mortal --seed $seed \
        --staleness 0 --compile-scope layer --logs "/tmp/logs-learning-s$seed" \
        --json "$OUT/learning_gpu_mortal_s${seed}_st0_layer.json" > "/tmp/learning-s$seed.log" 2>&1
      echo "== learning seed $seed: exit $?"; tail -4 "/tmp/learning-s$seed.log"; cat "/tmp/learning-s$seed.log" >> "$OUT/all.log"
    done ;;
  # Issue 14 part 1 in one invocation (TRL's side so far ran on 2026-11-24, mortal's on 2026-11-28): both seeds of
  # each side at once, seed N on GPU N of an nvidia-h200-x2, so TRL's two 12-minute runs take one call's time
  # and a little of the next. TRL's runs outlive the call that starts them (setsid), from their own copies of
  # the installed packages and the bench (a later call reinstalls /tmp/site and replaces the tree). Calls, back
  # to back on one warm machine: 1 [".whl", ".mortal/p1"] profile-onegpu, 2 [".mortal/p2"] carry,
  # 3 [".mortal/p3", ".mortal/assets"] learning-trl-start, 4 [] learning-finish, 5 [] learning-mortal-st1.
  carry)  # only what device-setup does: install the wheels, keep the GGUF's parts (and join them when complete)
    ls /root/gguf-parts /root/smol.gguf 2>&1 ;;
  learning-trl-start)  # issue 14.1, call 3 of 5 (calls 1 and 2 carry the GGUF's first parts): TRL's seeds 0 and 1
    start_trl "0 1"
    wait_trl "0 1" 530 ;;
  learning-finish)  # TRL's runs to their end (about 3 more minutes), then mortal's on-policy seeds at once
    wait_trl "0 1" 300
    learning_mortal 0 280 ;;
  learning-mortal-st1)  # mortal's maxStaleness 1 seeds at once
    learning_mortal 1 280 ;;
  learning-seeds-start)  # issue 14.1's reward levels over more seeds (call 3 of 4, calls 1 and 2 carrying the GGUF's
                         # first parts): TRL's seeds 2-5 two a GPU, outliving the call, and beside them mortal's
                         # on-policy seeds 2-5, two at a time; every run --shares-gpu (rewards count, seconds do not)
    start_trl "2 3 4 5" --shares-gpu
    learning_mortal 0 290 "2 3" --shares-gpu
    learning_mortal 0 290 "4 5" --shares-gpu ;;
  learning-seeds-finish)  # call 4: mortal's maxStaleness 1 seeds 2-5 beside TRL's, then TRL's to their end
    learning_mortal 1 290 "2 3" --shares-gpu
    wait_trl "2 3 4 5" 280 ;;
  learning-seeds-more)  # when learning-seeds-start's call ran out (2026-11-28: seed 3 passed its 290 s with two TRL
                        # runs on its GPU, seeds 4 and 5 never began): on-policy seeds 3 and 4 with a longer limit
    for seed in 2 3 4 5; do echo "TRL seed $seed: $(grep -o '[0-9]*/200' /root/learn/trl_s$seed.log | tail -1)"; done
    learning_mortal 0 440 "3 4" --shares-gpu
    wait_trl "2 3 4 5" 100 ;;
  learning-seeds-last)  # after learning-seeds-more: TRL's seeds 4 and 5 back (one call returns a limited number of
                        # files), mortal's on-policy seed 5 and maxStaleness 1 seed 2, one a GPU
    cp /root/learn/trl_s4.json /root/learn/trl_s5.json "$OUT/"
    learning_mortal 0 320 "5" --shares-gpu &
    learning_mortal 1 320 "2" --shares-gpu
    wait ;;
  headstart)  # the start after the first tasks are queued before the actor's trainer is built (actor.queues_ahead) and
              # the actor's placeholder forward and backward while it waits (warms_up), both 2026-11-28: one GPU's
              # first step (before, kernels-doorbells: step 1 at 19.1-20.2 s between step ends, of which the
              # actor's first training step 2.5-3.7 s), then the GPU tests that run the actor through the controller
              # or compare its first step with the unsharded one's: carry [".whl", ".mortal/assets"]
    bench onegpu 170 --steps 6 --rollouts 1 --only mortal
    gpu_tests 480 "$R/tests/workers/test_gpu.py" "$R/tests/workers/actor/test_actor_sharded.py" -k "colocated or liger or ddp or cuda" ;;
  headstart-step)  # headstart's first half alone (one GPU's first step), as call 1 on a machine of four GPUs before
                   # the GGUF's carries and learning-x4-start, so the learning runs start early in the session
    bench onegpu 170 --steps 6 --rollouts 1 --only mortal ;;
  headstart-tests)  # headstart's second half (its GPU tests), after learning-x4-finish
    gpu_tests 480 "$R/tests/workers/test_gpu.py" "$R/tests/workers/actor/test_actor_sharded.py" -k "colocated or liger or ddp or cuda" ;;
  learning-headstart)  # issue 14.1 after the first tasks are queued before the actor's trainer is built (2026-11-28,
                       # actor.queues_ahead): mortal's on-policy seeds 0 and 1, each alone on its GPU, timed; their
                       # rewards should equal the runs before step for step (exact replay; the rollouts now answer
                       # step 0 with the model they loaded as version 0), their first step come sooner (before:
                       # 31.5 and 32.4 s). After the three calls that carry the GGUF: carry [".mortal/p3"] here
    learning_mortal 0 290 "0 1" ;;
  learning-x4-start)  # issue 14.1 in one invocation on four GPUs (run(..., kind="nvidia-h200-x4"), after the three
                      # calls that carry the GGUF; this one carries .mortal/p3): TRL's seeds 0 and 1 on GPUs 0 and 1
                      # (setsid: about 12 minutes), mortal's on-policy seeds 0-3 on GPUs 2 and 3 meanwhile, each alone
                      # on its GPU, so every run of both sides is timed; then learning-x4-finish
    start_trl "0 1"
    MORTAL_GPU_BASE=2
    learning_mortal 0 290 "0 1"
    learning_mortal 0 290 "2 3" ;;
  learning-x4-finish)  # mortal's maxStaleness 1 seeds 0 and 1 on GPUs 2 and 3, then TRL's runs to their end (exit 3:
                       # then learning-x4-wait)
    MORTAL_GPU_BASE=2
    learning_mortal 1 290 "0 1"
    wait_trl "0 1" 280 ;;
  learning-x4-more)  # after learning-x4-finish (2026-11-28: learning-x4-start's call ran out before seeds 2 and 3):
                     # mortal's on-policy seeds 2 and 3 on GPUs 2 and 3, headstart's GPU tests on GPUs 0 and 1 beside
    MORTAL_GPU_BASE=2
    (CUDA_VISIBLE_DEVICES=0,1 gpu_tests 480 "$R/tests/workers/test_gpu.py" "$R/tests/workers/actor/test_actor_sharded.py" \
       -k "colocated or liger or ddp or cuda" > /tmp/headstart-tests.out 2>&1) &
    learning_mortal 0 290 "2 3"
    wait
    tail -15 /tmp/headstart-tests.out ;;
  learning-tf32-start)  # issue 14.1 with TF32 matmuls on both sides (--tf32; what a user turns on on an H100 or
                        # H200), four H200s, after two `carry` calls ([".whl", ".mortal/p1"], [".mortal/p2"]); this
                        # one carries .mortal/p3: TRL's seeds 0 and 1 on GPUs 0 and 1 (setsid), mortal's on-policy
                        # seeds 0-3 on GPUs 2 and 3, each run alone on its GPU; then learning-tf32-finish
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    start_trl "0 1"
    MORTAL_GPU_BASE=2
    learning_mortal 0 270 "0 1"
    learning_mortal 0 270 "2 3" ;;
  learning-tf32-finish)  # mortal's maxStaleness 1 seeds 0 and 1 on GPUs 2 and 3, TRL's seeds 0 and 1 to their end,
                         # then TRL's seeds 2 and 3 on GPUs 0 and 1 (setsid); then learning-tf32-last
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    MORTAL_GPU_BASE=2
    learning_mortal 1 270 "0 1"
    wait_trl "0 1" 280
    start_trl "2 3" ;;
  learning-tf32-last)  # mortal's on-policy seeds 4 and 5 on GPUs 2 and 3, then TRL's seeds 2 and 3 to their end
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    MORTAL_GPU_BASE=2
    learning_mortal 0 270 "4 5"
    wait_trl "2 3" 540 ;;
  learning-tf32-more)  # when learning-tf32-start's call ran out before mortal's on-policy seeds 2 and 3 (2026-11-28:
                       # learning_mortal's bare `wait` waited for TRL's runs, since fixed): seeds 2-5 on GPUs 2 and 3,
                       # then TRL's seeds 2 and 3 to their end (in place of learning-tf32-last)
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    MORTAL_GPU_BASE=2
    learning_mortal 0 200 "2 3"
    learning_mortal 0 200 "4 5"
    wait_trl "2 3" 540 ;;
  learning-tf32-again)  # issue 14.1's second TF32 invocation ("run twice, the lower reported"), four H200s, after two
                        # `carry` calls; this one carries .mortal/p3: TRL's seeds 0 and 1 on GPUs 0 and 1 (setsid),
                        # mortal's on-policy seeds 0-5 on GPUs 2 and 3, two at a time, each run alone on its GPU
                        # (about 400 s); then learning-tf32-again-finish. TRL's seeds 2 and 3 are not rerun: their
                        # rewards replay bit for bit (seeds 0 and 1 here show it or not)
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    start_trl "0 1"
    MORTAL_GPU_BASE=2
    learning_mortal 0 200 "0 1"
    learning_mortal 0 200 "2 3"
    learning_mortal 0 200 "4 5" ;;
  learning-tf32-again-finish)  # mortal's maxStaleness 1 seeds 0 and 1 on GPUs 2 and 3, then TRL's seeds 0 and 1 to
                               # their end
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    MORTAL_GPU_BASE=2
    learning_mortal 1 200 "0 1"
    wait_trl "0 1" 400 ;;
  oom-test)  # the out-of-memory diagnosis GPU test alone (its 4 MiB share, fixed 2026-11-28 after it failed on an
             # H200); [".mortal/assets"]
    gpu_tests 240 "$R/tests/workers/test_gpu.py" -k "out_of_memory" ;;
  learning-tf32-x2-trl)  # the TF32 learning bench on two H200s (when no four-GPU machine is lent), after two `carry`
                         # calls; this one carries .mortal/p3: TRL's seeds 0 and 1 alone on GPUs 0 and 1 (setsid),
                         # to their end when the call allows (exit 3: then learning-tf32-x2-mortal's wait_trl)
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    start_trl "0 1"
    wait_trl "0 1" 560 ;;
  learning-tf32-x2-mortal)  # TRL's TF32 seeds to their end, then mortal's on-policy seeds 0-3, two at a time, each
                            # alone on its GPU
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    wait_trl "0 1" 200
    learning_mortal 0 190 "0 1"
    learning_mortal 0 190 "2 3" ;;
  learning-tf32-x2-st1)  # mortal's TF32 maxStaleness 1 seeds 0 and 1, then on-policy seeds 4 and 5
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32
    learning_mortal 1 270 "0 1"
    learning_mortal 0 190 "4 5" ;;
  # Issue 14.1's second TF32 invocation on one H200 (2026-11-28: only nvidia-h200 lent): TRL's seed 0 alone on the
  # GPU (setsid, about 10 minutes), then mortal's runs one after another, each alone; every run is timed. TRL's
  # seeds 1-3 and mortal's seeds not rerun here count for rewards only (learning_gpu.py --report --rewards-only),
  # where the runs made here replay the first invocation's bit for bit. Calls, back to back on one warm machine:
  # 1 [".whl", ".mortal/p1"] carry, 2 [".mortal/p2"] carry, 3 [".mortal/p3"] learning-one-trl,
  # 4 [] learning-one-mortal, 5 [] learning-one-more.
  learning-one-trl)  # TRL's seed 0 to its end when the call allows (exit 3: learning-one-mortal waits the rest)
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32 LEARNING_GPUS=1
    start_trl "0"
    wait_trl "0" 555 ;;
  learning-one-mortal)  # TRL's seed 0 to its end, then mortal's on-policy seeds 0-3, one after another
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32 LEARNING_GPUS=1
    wait_trl "0" 150
    learning_alone 0 170 570 "0 1 2 3" ;;
  learning-one-more)  # mortal's on-policy seeds 4 and 5 (and any learning-one-mortal left), then maxStaleness 1 seed 0
    LEARNING_FLAGS=--tf32 LEARNING_TAG=_tf32 LEARNING_GPUS=1
    learning_alone 0 170 570 "${SEEDS:-4 5}"
    learning_alone 1 170 570 "0" ;;
  learning-x4-wait)
    wait_trl "0 1" 560 ;;
  learning-seeds-wait)  # a call 5 if TRL's seeds were not done by the end of call 4 (exit 3 there)
    wait_trl "2 3 4 5" 560 ;;
  offload)  # actor.cpuOffload on two GPUs (the mixed-precision test's offload case; without offload it passed on
            # two H200s, 2026-11-28): failed 2026-11-27 (the tied head) and 2026-11-28 (DTensor.from_local put the
            # placed shards back on the GPU: models.with_local_shard)
    gpu_tests 300 "$R/tests/workers/actor/test_actor_sharded.py" -k "mixed_precision and True" ;;
  fused-loss)  # issue 15.1's memory-lean step: TRL's fused LM head (what the actor's loss runs, trl_seam assumption 6)
               # against whole-vocabulary logits, bf16, 64 x (32 + 256) tokens, at Qwen2.5's shapes with Qwen's own
               # vocabulary (151,936) and, at 0.5B, the benches' SmolLM2 one (49,152); each shape one process, the two
               # losses in the order LOSSES gives (run twice, the order swapped: "fused full", then "full fused")
    for shape in "0.5b 151936 64" "1.5b 151936 16" "3b 151936 8" "0.5b 49152 64"; do
      set -- $shape
      train_step "train_step_${1}_v${2}_${LOSS_TAG:-run1}" 150 --shape "$1" --vocab "$2" --micro-batch "$3" \
        --precision bf16 --loss ${LOSSES:-fused full} --prompt-len 32 --completion-len 256 --fixed-lengths --steps 6
    done ;;
  seven-b-full-one)  # the 7B shape's full fine-tune on ONE H200 (141 GB: mortalctl apply's bound is 110 GB with the
                     # colocated rollout and the ring of 3), beside TRL in the same invocation
    bench sevenb_full_onegpu_${RUN_TAG:-run1} 570 --shape 7b --micro-batch 8 --steps 4 ${EXTRA:-} ;;
  heal-1.5b|heal-3b|heal-7b-lora)  # issue 44: NO --micro-batch on mortal's side, so it trains with the operator's
                                   # own choice (mortalctl apply's estimate, halved after an out-of-memory:
                                   # "mortal_memory" in the JSON); TRL given by hand the micro batch the earlier
                                   # one-GPU runs at that shape used (the whole batch in one pass does not fit TRL at
                                   # 3B on an H100). One group a call.
    shape=${group#heal-}
    case $shape in 1.5b) trl_micro=16 ;; *) trl_micro=8 ;; esac
    bench "heal_${shape}_${RUN_TAG:-run1}" "${LIMIT:-570}" --shape "${shape%-lora}" --steps 4 --trl-micro-batch "$trl_micro" \
      $([ "$shape" = 7b-lora ] && echo --lora 16) ${EXTRA:-} ;;
  *) echo "unknown group $group" >&2; exit 2 ;;
esac

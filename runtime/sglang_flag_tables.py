"""SGLang's launch flags that tandem takes without a ServerArgs field, grouped by the reason
(sglang_flags.py reads them). With ServerArgs' own fields they cover every flag of SGLang 0.5.23
(tests/runtime/data/sglang_flags_0.5.23.json) and a few older spellings.

How a flag is written here (its arity follows SGLang's parser, so an SGLang command parses alike):
    --flag          a switch
    --[no-]flag     a switch with its --no- form (a --no- form asks for nothing refused)
    --flag=         one value;  --flag=a|b  one value, where a and b ask for what tandem does anyway
                    (accepted and logged; only in REFUSED)
    --flag+ --flag* --flag?     one or more values, any number, an optional value
    --flag,--alias= more spellings of the same flag, comma-separated

IGNORED: tandem's answers and API are the same without the flag: it tunes speed, memory, kernels,
scheduling, a parallel layout or an observability extra that tandem does not have, or it only
applies with a feature that a flag in REFUSED asks for (that flag is refused instead). Logged at
start, with the reason.

REFUSED: honouring it would change an answer or what a client sees (weights, numerics, tokenizer,
templates, response fields, protocols), or it asks tandem to take part in a system it lacks.
Tandem exits at start naming the flag, why, and what to use instead.
"""
from __future__ import annotations

IGNORED: dict[str, str] = {
    "tandem captures no CUDA graphs": """
        --disable-cuda-graph --cuda-graph-max-bs= --cuda-graph-config= --cuda-graph-backend-decode=
        --cuda-graph-backend-prefill= --cuda-graph-max-bs-decode= --cuda-graph-max-bs-prefill=
        --cuda-graph-bs-decode+ --cuda-graph-bs-prefill+ --cuda-graph-prefill-max-context,--context-bucket=
        --cuda-graph-max-seq-len-prefill= --disable-prefill-cuda-graph --disable-decode-cuda-graph
        --disable-cuda-graph-padding --enable-profile-cuda-graph --enable-cudagraph-gc --debug-cuda-graph
        --startup-weight-load-mode=""",
    "tandem does not torch.compile its model": """
        --enable-torch-compile --enable-torch-compile-debug-mode --torch-compile-max-bs=""",
    "tandem runs its own attention, GEMM and sampling kernels (Triton on GPU, C++/torch on CPU); "
    "--attention-backend picks among them": """
        --decode-attention-backend= --prefill-attention-backend= --enable-lean-attention
        --bf16-gemm-backend= --disable-flashinfer-autotune --flashinfer-autotune-skip-ops+
        --triton-attention-reduce-in-fp32 --triton-attention-num-kv-splits= --triton-attention-split-tile-size=
        --flashinfer-mla-disable-ragged --[no-]enable-fused-qk-norm-rope --moe-runner-backend=
        --enable-waterfill --disable-shared-experts-fusion --enforce-shared-experts-fusion
        --enable-amd-monokernel --monokernel-backend= --enable-nvidia-megakernel --sampling-backend=""",
    "it tunes kernels for fp8, fp4 or mxfp4 weights, which tandem does not serve": """
        --fp8-gemm-backend= --fp4-gemm-backend= --enable-w4a4-mxfp4-megamoe --flashinfer-mxfp4-moe-precision=
        --disable-flashinfer-cutlass-moe-fp4-allgather --prefill-kv-cache-dequant-dtype=""",
    "tensor parallelism uses torch.distributed's collectives (gloo on CPU, NCCL on GPU)": """
        --disable-custom-all-reduce --enable-p2p-check --enable-nccl-nvls --enable-symm-mem --enable-mscclpp
        --enable-torch-symm-mem --pre-warm-nccl --boundary-reduction= --enforce-disable-flashinfer-allreduce-fusion
        --flashinfer-allreduce-fusion-backend= --enable-flashinfer-allreduce-fusion --enable-aiter-allreduce-fusion
        --disable-aiter-allreduce-fusion-in-prefill --disable-aiter-allreduce-fusion-in-decode
        --enable-fused-moe-sum-all-reduce --nccl-port=""",
    "tandem splits a model by tensor parallelism only (no context, sequence or attention-data parallel "
    "layouts, no pipeline stages)": """
        --enable-dp-attention --load-balance-method= --dcp-comm-backend= --[no-]dcp-replicate-q-proj
        --enable-prefill-cp --cp-strategy= --enable-dsa-cache-layer-split --enable-cp-decode-attn-tp
        --enable-kv-cache-sharding --enable-dp-attention-local-control-broadcast --enable-dp-lm-head
        --[no-]enable-tp-lm-head-all-to-all --enable-attn-tp-input-scattered --enable-shared-experts-attn-tp
        --shared-experts-tp-size= --enable-dense-mlp-attn-tp --enable-layernorm-sp --disable-attn-tp-gather
        --moe-dense-tp-size= --enable-megamoe-for-layernorm-sp --pp-max-micro-batch-size= --pp-async-batch-depth=
        --enable-dynamic-chunking --enable-two-batch-overlap --enable-single-batch-overlap
        --tbo-token-distribution-threshold= --enable-pdmux --pdmux-config-path= --sm-group-num=""",
    "tandem runs one expert-parallel rank (experts are split by tensor parallelism)": """
        --moe-a2a-backend= --deepep-v2-mode= --deepep-mode= --fuseep-mode= --deepep-dispatcher-output-dtype=
        --deepep-config= --flashinfer-a2a-dispatch-type= --ep-num-redundant-experts= --ep-dispatch-algorithm=
        --init-expert-location= --enable-eplb --eplb-algorithm= --eplb-rebalance-num-iterations=
        --eplb-rebalance-layers-per-chunk= --eplb-min-rebalancing-utilization-threshold=
        --expert-distribution-recorder-mode= --expert-distribution-recorder-buffer-size=
        --expert-balancedness-report-mode=""",
    "it tunes elastic expert parallelism, which tandem refuses (--elastic-ep-backend)": """
        --enable-elastic-expert-backup --mooncake-ib-device= --elastic-ep-join-mode= --elastic-ep-join-rank-offset=
        --elastic-ep-initial-size= --max-ep-size= --elastic-ep-scale-timeout=""",
    "tandem schedules by its own rules (--max-running-requests, --chunked-prefill-size, --schedule-policy); "
    "the order of steps changes no answer": """
        --prefill-decode-interval= --prefill-decode-interval-min-bs= --prefill-max-requests= --retraction-policy=
        --schedule-conservativeness= --num-continuous-decode-steps= --scheduler-recv-interval= --enable-mixed-chunk
        --num-reserved-decode-tokens= --enable-prefill-delayer --prefill-delayer-max-delay-passes=
        --prefill-delayer-token-usage-low-watermark= --prefill-delayer-forward-passes-buckets+
        --prefill-delayer-wait-seconds-buckets+ --prefill-delayer-queue-min-ratio= --prefill-delayer-max-delay-ms=
        --min-free-slots-delay= --batch-notify-size=""",
    "tandem sets its processes' threads, CPU affinity and garbage collection itself": """
        --sleep-on-idle --numa-node+ --gc-threshold+""",
    "tandem's KV cache is one token-granular pool with a radix prefix cache in it; "
    "where cached prefixes live changes no answer": """
        --page-size= --c128-page-size= --swa-full-tokens-ratio= --disable-hybrid-swa-memory --radix-eviction-policy=
        --radix-eviction-policy-config= --enable-page-major-kv-layout --enable-unified-memory
        --disable-chunked-prefix-cache --strip-thinking-cache --enable-session-radix-cache
        --enable-hierarchical-cache,--enable-hicache --hicache-host-memory-mode= --hicache-ratio= --hicache-size=
        --hicache-write-policy= --hicache-io-backend= --hicache-mem-layout= --hicache-storage-backend=
        --hicache-storage-prefetch-policy= --hicache-storage-backend-extra-config=
        --hicache-storage-prefetch-retry-poll-interval= --hicache-storage-prefetch-retry-max-attempts=
        --hicache-host-memory-fraction= --enable-unified-cache-external-linker
        --unified-cache-external-linker-backend= --unified-cache-external-linker-config= --enable-linker-mla-dedup
        --enable-lmcache --lmcache-config-file= --enable-flexkv --flexkv-config-file=
        --prefill-only-disable-kv-cache --radix-cache-backend=""",
    "tandem keeps every weight on its device (no CPU offload)": """
        --cpu-offload-gb= --offload-group-size= --offload-num-in-group= --offload-prefetch-step= --offload-mode=
        --[no-]ple-offload-embedding --ple-offload-backend= --ple-offload-dir= --enable-paged-experts
        --paged-experts-num-resident= --enable-weights-cpu-backup --enable-draft-weights-cpu-backup""",
    "tandem reads the checkpoint's safetensors (or GGUF) files itself, once, and downloads nothing "
    "(a hub id is read from the Hugging Face cache)": """
        --weight-loader-disable-mmap --weight-loader-prefetch-checkpoints --weight-loader-prefetch-num-threads=
        --weight-loader-drop-cache-after-load --delete-ckpt-after-loading --download-dir= --weight-cache-mode=
        --weight-cache-socket= --weight-cache-timeout= --engine-info-bootstrap-port=""",
    "tandem runs no code from a checkpoint (--model-impl transformers runs transformers' own classes)":
        "--trust-remote-code",
    "outlines only: tandem's grammars are xgrammar's": "--disable-outlines-disk-cache",
    "it tunes remote weight loading, which tandem refuses (--load-format remote_instance)": """
        --remote-instance-weight-loader-seed-instance-ip= --remote-instance-weight-loader-seed-instance-service-port=
        --remote-instance-weight-loader-send-weights-group-ports= --remote-instance-weight-loader-backend=
        --remote-instance-weight-loader-start-seed-via-transfer-engine --modelexpress-config=""",
    "it tunes a model family tandem does not serve (Mamba and linear attention, DeepSeek V3.2/V4 sparse "
    "attention, Qwen4-Exp, Inkling)": """
        --mamba-backend= --max-mamba-cache-size= --mamba-ssm-dtype= --mamba-max-states-per-path=
        --enable-mamba-cache-stochastic-rounding --mamba-cache-philox-rounds= --mamba-full-memory-ratio=
        --mamba-radix-cache-strategy= --mamba-track-interval= --enable-int8-mamba-checkpoint --int8-mamba-ckpt-size=
        --linear-attn-backend= --linear-attn-decode-backend= --linear-attn-prefill-backend=
        --linear-attn-verify-backend= --enable-linear-replayssm --linear-replayssm-cache-len=
        --enable-linear-replayssm-spec --dsa-prefill-backend= --dsv4-prefill-backend= --dsa-decode-backend=
        --dsa-paged-mqa-logits-backend= --dsa-topk-backend= --dsa-triton-union= --[no-]enable-dsa-fused-indexer
        --dsv4-attn-backend= --enable-deepseek-v4-fp4-indexer --enable-encoder-swa-bounded-replay
        --[no-]enable-decoder-swa-bounded-replay --swa-prefix-tails= --qsa-indexer-dtype= --enable-scattered-sconv""",
    "tandem serves text only (image, video and audio inputs are refused per request)": """
        --mm-attention-backend= --enable-precise-embedding-interpolation --enable-broadcast-mm-inputs-process
        --enable-prefix-mm-cache --[no-]mm-enable-dp-encoder --mm-process-config= --mm-processor-worker-num=
        --mm-io-worker-num= --allowed-media-domains+ --media-url-max-file-size-mb= --mm-preprocess-cache-size-mb=
        --trust-mm-content-hashes --limit-mm-data-per-request= --enable-mm-global-cache --image-processor-backend=
        --mm-global-cache-backend= --disable-fast-image-processor --mm-feature-transport= --language-model-only
        --asr-max-buffer-seconds= --asr-max-concurrent-sessions=""",
    "it tunes LoRA adapters, which tandem refuses (--enable-lora, --lora-paths)": """
        --enable-lora-overlap-loading --max-lora-rank= --lora-target-modules* --max-loaded-loras=
        --max-loras-per-batch= --lora-eviction-policy= --lora-backend= --max-lora-chunk-size=
        --[no-]experts-shared-outer-loras --lora-use-virtual-experts --[no-]lora-strict-loading
        --lora-drain-wait-threshold=""",
    "it tunes the draft side of speculative decoding: every token is verified by the target model, "
    "so drafts change speed only (tandem's NGRAM and STANDALONE drafts form one chain)": """
        --speculative-eagle-topk= --speculative-dflash-block-size= --speculative-dspark-block-size=
        --speculative-dspark-sps-table-path= --speculative-dspark-confidence-sts-path=
        --speculative-dspark-align-verify-tokens-to-graph-tier --speculative-use-rejection-sampling
        --speculative-use-block-verification --speculative-token-map= --speculative-attention-mode=
        --speculative-draft-attention-backend= --speculative-dsa-topk-backend= --speculative-draft-kv-cache-dtype=
        --speculative-draft-window-size= --speculative-draft-sink-size= --speculative-moe-runner-backend=
        --speculative-moe-a2a-backend= --[no-]speculative-enable-w4a4-mxfp4-megamoe
        --speculative-draft-model-quantization= --enable-multi-layer-eagle --speculative-adaptive
        --speculative-adaptive-config= --spec-trace-dir= --speculative-ngram-min-bfs-breadth=
        --speculative-ngram-max-bfs-breadth= --speculative-ngram-match-type= --speculative-ngram-max-trie-depth=
        --speculative-ngram-capacity= --speculative-ngram-external-corpus-path=
        --speculative-ngram-external-sam-budget= --speculative-ngram-external-corpus-max-tokens=
        --speculative-domino-candidate-pool-size= --uno-lora-path=""",
    "it tunes decoupled speculative decoding, which tandem refuses (--decoupled-spec-role)": """
        --decoupled-spec-bind-endpoint= --decoupled-spec-connect-endpoints= --decoupled-spec-rank=""",
    "it tunes prefill/decode or encoder disaggregation, which tandem refuses (--disaggregation-mode, "
    "--encoder-only, --language-only)": """
        --disaggregation-transfer-backend= --disaggregation-bootstrap-port= --disaggregation-ib-device=
        --disaggregation-decode-enable-radix-cache --disaggregation-decode-enable-offload-kvcache
        --disaggregation-decode-retraction-backup= --disaggregation-decode-extra-slots=
        --disaggregation-decode-polling-interval= --optimistic-prefill-attempts= --disaggregation-enable-kv-checksum
        --enable-pd-role-switch --disaggregation-decode-host-receive-threshold=
        --disaggregation-decode-allocation-policy= --encoder-transfer-backend= --encoder-urls+
        --encoder-bootstrap-port= --encoder-register-urls+ --enable-adaptive-dispatch-to-encoder""",
    "it tunes a feature that a refused flag asks for (--dllm-algorithm, --kt-weight-path, --enable-http2, "
    "--smg-grpc-mode, --enable-forward-pass-metrics)": """
        --dllm-algorithm-config= --[no-]dllm-fdfo --kt-method= --kt-cpuinfer= --kt-threadpool-count=
        --kt-num-gpu-experts= --kt-max-deferred-experts-per-token= --http2-max-concurrent-streams=
        --http2-initial-connection-window-size= --smg-http-sidecar-port,--grpc-http-sidecar-port=
        --forward-pass-metrics-worker-id= --forward-pass-metrics-ipc-name=""",
    "tandem runs one tokenizer and one detokenizer process, tokenizing each request as it comes": """
        --tokenizer-worker-num= --detokenizer-worker-num= --tokenizer-backend= --enable-dynamic-batch-tokenizer
        --dynamic-batch-tokenizer-batch-size= --dynamic-batch-tokenizer-batch-timeout=
        --enable-tokenizer-batch-encode --disable-tokenizer-batch-decode""",
    "/metrics is always served, with SGLang's metric names and default buckets; tandem has no other metrics, "
    "traces or exports": """
        --enable-metrics --enable-mfu-metrics --enable-metrics-for-all-schedulers --load-snapshot-publish-interval=
        --tokenizer-metrics-custom-labels-header= --tokenizer-metrics-allowed-custom-labels+ --extra-metric-labels=
        --bucket-time-to-first-token+ --bucket-inter-token-latency+ --bucket-e2e-request-latency+
        --prompt-tokens-buckets+ --generation-tokens-buckets+ --enable-request-time-stats-logging
        --enable-trace --trace-modules= --otlp-traces-endpoint= --otlp-service-name= --export-metrics-to-file
        --export-metrics-to-file-dir=""",
    "usage.prompt_tokens_details.cached_tokens is always reported": "--enable-cache-report",
    "tandem logs at --log-level, decode batches at its own interval, and writes no access log": """
        --log-level-http= --uvicorn-access-log-exclude-prefixes* --decode-log-interval= --show-time-cost
        --gc-warning-threshold-secs=""",
    "tandem has no debug dumps, canaries or profiling markers (they change no answer)": """
        --crash-dump-folder= --debug-tensor-dump-output-folder= --debug-tensor-dump-layers+
        --debug-tensor-dump-input-file= --enable-layerwise-nvtx-marker --kv-canary= --kv-canary-sweep-interval=
        --kv-canary-real-data= --msprobe-dump-config= --soft-watchdog-timeout=""",
    "tandem sends no warm-up request": "--skip-server-warmup --warmups=",
    "it tunes a request kind tandem does not serve (sampling masks, multi-item scoring, the files API)": """
        --sampling-mask-max-tokens= --enable-mis --file-storage-path=""",
    "tandem's gRPC streams wait for each chunk as long as the request runs": "--grpc-response-timeout-secs=",
    "tandem's HTTP server starts one worker (uvicorn)": "--enable-http-worker-reuseport",
    "requests may always ask for return_hidden_states (every token's, as SGLang's 'full' mode)":
        "--enable-return-hidden-states",
    "tandem's LM head always computes fp32 logits (fp32 sums over the hidden state)": "--enable-fp32-lm-head",
    "the MLX backend's option (tandem runs on CUDA or CPU)": "--mlx-enable-sampling",
    "tandem's old flag: preemption is now the default with priority scheduling": "--priority-preemption",
}

REFUSED: dict[str, str] = {
    "tandem serves GGUF blocks, GPTQ/AWQ int4 and w8a8_int8 checkpoints (--quantization gguf, gptq, awq, "
    "w8a8_int8) and no ModelOpt or calibration flow: serve one of those or an unquantized checkpoint": """
        --quantization-param-path= --modelopt-quant= --modelopt-checkpoint-restore-path=
        --modelopt-checkpoint-save-path= --modelopt-export-path= --quantize-and-serve --rl-quant-profile=
        --kt-weight-path= --enable-quant-communications""",
    "tandem serves no LoRA adapters: serve a checkpoint with the adapter merged into its weights":
        "--enable-lora --lora-paths*",
    "tandem serves text decoders (generation, or embeddings with --is-embedding): no multimodal, "
    "diffusion or encoder-only models": """
        --enable-multimodal --dllm-algorithm= --encoder-only --language-only""",
    "tandem reads safetensors folders and GGUF files itself: give --model-path the checkpoint folder": """
        --load-format=auto|safetensors|gguf --speculative-draft-load-format=auto|safetensors|gguf
        --model-config-parser=auto|hf --model-loader-extra-config={} --custom-weight-loader*""",
    "tandem serves --model-path's weights from the start (replace them later with update_weights_from_*)":
        "--checkpoint-engine-wait-weights-before-ready",
    "tandem does not verify checkpoint checksums: check the files before starting (sha256sum -c)":
        "--model-checksum?",
    "tandem serves the checkpoint as it is on disk: give --model-path the folder of that revision "
    "(a hub id is read from the Hugging Face cache's snapshot of main)": """
        --revision=main --speculative-draft-model-revision=main --decrypted-config-file=
        --decrypted-draft-config-file=""",
    "tandem serves the checkpoint's config.json as it is: edit a copy of the checkpoint instead":
        "--json-model-override-args={}",
    "tandem's numerics are its kernels' (float32 matmuls in full float32, dense attention, every "
    "expert computed); the flag would change the answers": """
        --[no-]enable-tf32-matmul --enable-hisparse --hisparse-config,--hierarchical-sparse-attention-extra-config=
        --rl-on-policy-target= --speculative-accept-threshold-single=1.0|1
        --speculative-accept-threshold-acc=1.0|1 --enable-watermark --watermark-config= --forward-hooks=""",
    "tandem tokenizes with the model's fast (Rust) tokenizer and always returns text":
        "--tokenizer-mode=auto --skip-tokenizer-init",
    "tandem renders chats with the checkpoint's chat template or --chat-template's file (chat_template_kwargs "
    "per request); it has no other templates": """
        --hf-chat-template-name=default --completion-template=
        --trust-request-chat-template""",
    "tandem's JSON grammars (xgrammar) allow free whitespace, or none with "
    "--constrained-json-disable-any-whitespace": """
        --constrained-json-whitespace-pattern= --constrained-json-max-whitespace-cnt=""",
    "the flag adds response fields or APIs tandem does not have (hidden states come whole with "
    "return_hidden_states; ids with /generate)": """
        --return-hidden-states-mode=full --enable-return-routed-experts --enable-return-indexer-topk
        --enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids+ --return-input-ids
        --return-output-ids --enable-custom-logit-processor --preferred-sampling-params= --tool-server=
        --enable-response-store --enable-streaming-session --enable-memory-saver""",
    "tandem serves plain HTTP/1.1 at /: terminate TLS and HTTP/2, and strip a path prefix, in a proxy in "
    "front of it": """
        --ssl-keyfile= --ssl-certfile= --ssl-ca-certs= --ssl-keyfile-password= --enable-ssl-refresh
        --enable-http2 --fastapi-root-path=""",
    "tandem serves SGLang's gRPC service and the gateway's scheduler service beside HTTP: use --grpc-port": """
        --smg-grpc-mode --grpc-mode --sidecar= --sidecar-args=""",
    "tandem runs as one whole server (data parallelism, if any, is the gateway's: smg --dp-aware); it takes "
    "no part in disaggregated, decoupled or elastic serving": """
        --disaggregation-mode=null --decoupled-spec-role=null --elastic-ep-backend=none --use-ray
        --gated-launch-port=""",
    "tandem publishes no KV-cache events, load snapshots or forward-pass metrics for a router or planner; "
    "route without them": """
        --kv-events-config= --load-publish-endpoint=off --enable-forward-pass-metrics""",
    "tandem writes request logs as text lines to its own log (stderr): redirect that": """
        --log-requests-format=text --log-requests-target+""",
    "tandem takes the GPUs CUDA_VISIBLE_DEVICES shows it: set that to the GPUs to use":
        "--base-gpu-id=0 --gpu-id-step=1",
}

# SGLang's parallelism sizes for what tandem runs as one rank: accepted at 1, refused above
SINGLE_RANK: dict[str, tuple[str, ...]] = {
    "dp_size": ("--dp-size", "--dp", "--data-parallel-size"),
    "ep_size": ("--ep-size", "--ep", "--expert-parallel-size"),
    "pp_size": ("--pp-size", "--pipeline-parallel-size"),
    "attn_dp_size": ("--attn-dp-size", "--attention-data-parallel-size"),
    "attn_cp_size": ("--attn-cp-size", "--attention-context-parallel-size"),
    "moe_dp_size": ("--moe-dp-size", "--moe-data-parallel-size"),
    "dcp_size": ("--dcp-size", "--decode-context-parallel-size"),
    "dwdp_size": ("--dwdp-size",),
}

# SGLang's other spellings of ServerArgs fields that server_args.py does not register
ALIASES: dict[str, str] = {"--nccl-init-addr": "dist_init_addr"}

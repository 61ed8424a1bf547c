#!/bin/sh
# best config of study shapes-casestudy (trial 1)
OMP_NUM_THREADS=8 VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random vllm serve /root/models/nemotron3-nano-30b-a3b-mtp --max-model-len 2048 --load-format dummy --async-scheduling --mamba-backend triton --mamba-ssm-cache-dtype float32 --max-num-seqs 1024 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.92 --kv-cache-dtype auto --enable-chunked-prefill --no-enable-prefix-caching --performance-mode balanced --max-cudagraph-capture-size 768

#!/bin/sh
# best config of study shapes-mooncake (trial 3; judged again by rejudge.py)
VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random vllm serve /root/models/nemotron3-nano-30b-a3b-mtp --max-model-len 2048 --load-format dummy

"""deepinfer-eplb: expert placement policies (``greedy_multistep``, ``deepseek``) and the rebalance schedule."""

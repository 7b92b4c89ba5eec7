"""Evaluation of trained checkpoints: what users judge a long-context model by (issue 16).

- `dsv41.eval.perplexity`: perplexity on held-out text, and NLL by position in the context;
- `dsv41.eval.retrieval`: passkey, needle-in-a-haystack (single and multi-key) and RULER-style variable
  tracking over a length x depth grid, with a heat map;
- `dsv41.eval.recall`: indexer recall, the share of the dense attention mass over the compressed cache
  that the selected top-k entries capture, per layer and context length;
- `dsv41.eval.cost`: what bounded-replay prefill and FP4 KV storage cost against full prefill and a bf16
  KV cache on the same prompts (NLL, KL, greedy agreement);
- `dsv41.eval.common`: model loading, held-out text, lengths, tables, JSON and plots.

`dsv41 eval ppl|passkey|niah|vartrack|recall|cost|all` runs them (docs/eval.md). Modules are imported by
name; this file imports nothing, so optional integrations living here stay optional.
"""

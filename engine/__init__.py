"""specd engine: speculative decoding over a target model and a drafter.

Modules, each owning one thing:
  loader        model specs -> prepared safetensors folders -> loaded HF models + tokenizer
  kv_cache      slot-based static KV cache (per layer [slots, kv_heads, max_len+1, head_dim])
  model_runner  our own decoder-layer loop over HF weights, reading/writing the slot cache
  sampling      sampling params and logits -> probabilities (temperature, top-k, top-p)
  rejection     the pure rejection-sampling rule (no model inside)
  drafters/     the proposers: n-gram prompt lookup, draft model
  sequence      one request's state inside the engine
  engine        the speculative round: propose -> verify -> accept -> commit/rollback
"""

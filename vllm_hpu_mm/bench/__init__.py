"""``vllm-hpu-mm bench throughput``: offline throughput of the plugin, and of HF.

- ``datasets``: the requests (seeded ``random`` text, seeded ``random-mm`` with
  Pillow images, ``sharegpt4v`` JSON with local image files);
- ``stats``: percentiles, tokens/s and the report (its JSON schema);
- ``vllm_backend``: the requests through ``vllm.LLM`` with the plugin, with the
  plugin's counters and vLLM's prefix-cache counters;
- ``hf_backend``: the same requests through HF transformers ``generate``;
- ``plot``: padding per bucket and the latency distribution (matplotlib);
- ``cli``: the command line.

Importing the package imports neither torch nor vLLM.
"""

"""``tiny-moe-lm``: a small Mixtral-class MoE language model trained by moefleet on CPU.

Modules: :mod:`.model` (training-time module, stacked experts), :mod:`.convert` (to/from
HF ``MixtralForCausalLM``), :mod:`.losses`, :mod:`.sources` (text files as documents),
:mod:`.corpus` (tokenizer, token streams), :mod:`.train` (deterministic, resumable loop),
:mod:`.evaluate` (held-out perplexity, unigram baseline, expert balance), :mod:`.recipe`
(validated recipe) and :mod:`.entry` (the zoo entry; importing it registers
``tiny-moe-lm``). Nothing heavy (torch, transformers) is imported by this package itself.
"""

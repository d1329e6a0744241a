"""Data pipeline: sources → tokenizer → cached token shards → Lightning data modules.

`config` (the recipe's data and tokenizer sections) loads no torch; `modules` loads torch and
Lightning. Import names from the submodule that defines them.
"""

"""Data: gather text, tokenize it into token shards, sample training windows.

    config.py    DataConfig: the settings (imports nothing heavy)
    corpus.py    where text comes from: files, directories, globs, record files, the built-in corpus, HF datasets
    tokenizer.py byte-level BPE, GPT-2's vocabulary, or a tokenizer.json
    prepare.py   the pipeline: text in, token shards out (`fitgpt prepare`)
    shards.py    shard files and the resumable journal
    resume.py    continuing an interrupted preparation
    prepared.py  the prepared-data contract training checks (meta.json)
    loader.py    token shards as memmaps, sampled as random windows
"""

"""The hf task's streamed and packed data (--streaming, --packing): the
checks before a run, and the training split as a stream (data/streams.py)."""
from __future__ import annotations

from pathlib import Path

from textbox_like.core.errors import UserError


def check_streaming_and_packing(cfg):
    """--streaming and --packing: the heads and data they take, one line each where not."""
    options, data = cfg.task_options, cfg.data
    if options.packing and options.hf_head not in ("causal_lm", "masked_lm"):
        raise UserError(f"--packing packs documents for language modelling (--hf_head causal_lm or masked_lm); "
                        f"--hf_head {options.hf_head} takes one text per sample: drop --packing")
    if not options.streaming:
        return
    if options.hf_head == "sequence_classification":
        raise UserError("--streaming is for the text heads (causal_lm, masked_lm, seq2seq): a classification "
                        "head's classes come from a pass over all labels; drop --streaming")
    from textbox_like.data.streams import sniff_columns
    if not named_training_file(data) and not Path(data.data).exists():
        raise UserError(f"--streaming reads local files: --data {data.data} is not a file or directory")
    first = training_files(data, data.train_subset)[0]
    columns = sniff_columns(first)
    wanted = [options.text_column] + ([options.target_column] if options.hf_head == "seq2seq" else [])
    for name in wanted:
        if columns and name not in columns:
            raise UserError(f"{first} has no column {name!r}; its columns: {', '.join(columns)} (choose with "
                            f"--text_column / --target_column)")


def named_training_file(data):
    """--training-data where it names one file (else the split is found in --data)."""
    return data.training_data if data.training_data and Path(data.training_data).is_file() else None


def training_files(data, split) -> list:
    """The files of the streamed split ``split``: the one --training-data names, or those found in --data."""
    from textbox_like.data.streams import stream_files
    return stream_files(named_training_file(data) or data.data, split)


def streamed_split(cfg, split, tokenizer, columns, batcher):
    """The training split's files as a stream: tokenised as read (in --num-workers processes), shuffled by a
    seeded buffer, packed where --packing; a rank's units batched by ``batcher`` (data/text_batches.py)."""
    from textbox_like.data.hf_text import StreamEncoder, sample_tokens
    from textbox_like.data.stream_batches import StreamedData
    from textbox_like.data.streams import FileSource, SampleStream
    data, options = cfg.data, cfg.task_options
    files = training_files(data, split)
    source = FileSource(files, cfg.numerics.seed, shuffle=not data.no_shuffle)
    stream = SampleStream(source, seed=cfg.numerics.seed, encode=StreamEncoder(tokenizer, columns),
                          tokens=sample_tokens, shuffle_buffer=1 if data.no_shuffle else options.shuffle_buffer,
                          pack_to=options.max_length if options.packing else None, workers=data.num_workers)
    return StreamedData(stream, batcher.rows if options.packing else batcher.samples)

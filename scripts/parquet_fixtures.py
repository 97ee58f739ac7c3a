#!/usr/bin/env python3
"""Writes tests/fixtures/parquet/: Parquet files as Hugging Face's `datasets`
writes them (pyarrow, snappy; and zstd with several row groups), each beside
a JSONL file of the same records, which tests/prepare.rs prepares both of and
compares. Run once with pyarrow installed; the outputs are committed.

    python3 scripts/parquet_fixtures.py
"""
import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "parquet"


def write(name, rows, schema, jsonl=True, **options):
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, OUT / f"{name}.parquet", **options)
    if not jsonl:
        return
    with open(OUT / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    texts = [
        {"id": 1, "text": "w1 w2 w3 w4"},
        {"id": 2, "text": "w5 w5 w0 w9 w8 w7"},
        {"id": 3, "text": "w3 ünïcödé w2\nw1"},
        {"id": 4, "text": "w6"},
        {"id": 5, "text": "w2 w4 w6 w8 w0 w1 w3"},
        {"id": 6, "text": "w9 w9 w9"},
    ]
    write(
        "texts",
        texts,
        pa.schema([("id", pa.int64()), ("text", pa.string())]),
    )
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    chats = [
        {"messages": [
            {"role": "system", "content": "w5"},
            {"role": "user", "content": "w1 w2"},
            {"role": "assistant", "content": "w3 w3 w4"},
        ], "source": "a"},
        {"messages": [
            {"role": "user", "content": "w0"},
            {"role": "assistant", "content": "w1"},
            {"role": "user", "content": "w2 w2"},
            {"role": "assistant", "content": "w5"},
        ], "source": "b"},
        {"messages": [
            {"role": "user", "content": "w7 w8"},
            {"role": "assistant", "content": "w9"},
        ], "source": "c"},
        {"messages": [
            {"role": "user", "content": "w4"},
            {"role": "assistant", "content": "w6 w6 w6"},
        ], "source": "d"},
        {"messages": [
            {"role": "system", "content": "w0 w0"},
            {"role": "user", "content": "w3"},
            {"role": "assistant", "content": "w2 w1"},
        ], "source": "e"},
    ]
    schema = pa.schema([("messages", pa.list_(message)), ("source", pa.string())])
    write("chats", chats, schema)
    # zstd (polars' default), two rows a row group: chats.jsonl's records.
    write("chats_zstd", chats, schema, jsonl=False, compression="zstd", row_group_size=2)
    pairs = [
        {"prompt": "w1 w2 ", "completion": "w3 w4"},
        {"prompt": "w5 ", "completion": "w6 w7 w8"},
        {"prompt": "w0 w0 w0 ", "completion": "w9"},
        {"prompt": "w2 ", "completion": "w2 w3"},
    ]
    write(
        "pairs",
        pairs,
        pa.schema([("prompt", pa.string()), ("completion", pa.string())]),
    )


if __name__ == "__main__":
    main()

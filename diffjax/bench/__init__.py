"""Benchmarks and the on-device check (`device_check`, with its `budget` and `device_report`), importable;
`experiments/` holds their command lines."""

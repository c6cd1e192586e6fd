"""Tooling around the spec, not part of the library: the parity case table (`cases`), the `commlib` command
(`cli`) and its drivers (`parity`, `bench`), which run each frontend's `tools` runners as subprocesses."""

"""Kept only for test modules that still import `envs` from here; the registry is
`sglang_nsa_cp/envs.py`. Delete once no test imports `sglang_nsa_cp.sglang_ext.environ`."""

from sglang_nsa_cp.envs import envs  # noqa: F401

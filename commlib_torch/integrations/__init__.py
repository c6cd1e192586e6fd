"""Integrations of commlib's sequence-parallel attention with model libraries (optional extras, each imported
lazily): `commlib_torch.integrations.transformers` (transformers' attention registry) and
`commlib_torch.integrations.diffusers` (a diffusers attention backend and the model's edges)."""

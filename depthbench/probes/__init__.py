"""Layer-utilization probes (docs/design/probes.md). Every probe reads the residual
stream h_0..h_L through one function, `residual_stream`, which uses the models' own
`return_hidden` output, so all architectures are probed the same way."""

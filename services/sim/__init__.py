"""The spot-training simulator: one event engine (`engine`), strategies registered by
name (`strategies`), inputs (`model`, `traces`), the runner and table (`runner`), and the
CLI (`python -m services.sim`, `rhizome estimate`)."""

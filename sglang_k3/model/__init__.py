"""The embedded default model: a tiny Kimi-Linear-architecture checkpoint made offline."""

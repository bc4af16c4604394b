"""Balance: a per-host closed-loop balloon controller (docs/balance.md)."""

"""Memory: the SpecMemo footprint model, the budget plan, and measured process memory."""

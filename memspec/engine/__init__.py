"""The speculative decoding engine: sampling rules, the round loop, costs and calibration."""

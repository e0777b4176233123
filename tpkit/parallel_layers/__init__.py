"""tpkit.parallel_layers"""

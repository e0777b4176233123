"""tpkit.attention"""

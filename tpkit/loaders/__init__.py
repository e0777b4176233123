"""tpkit.loaders"""

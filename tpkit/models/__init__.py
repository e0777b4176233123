"""tpkit.models"""

"""tpurl.sharding"""

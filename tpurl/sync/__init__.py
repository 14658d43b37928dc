"""tpurl.sync"""

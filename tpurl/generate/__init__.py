"""tpurl.generate"""

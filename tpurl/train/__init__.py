"""tpurl.train"""

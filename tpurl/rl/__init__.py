"""tpurl.rl"""

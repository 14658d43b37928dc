"""tpurl.tasks"""

"""engine/models"""

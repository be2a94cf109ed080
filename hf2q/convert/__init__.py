"""convert"""

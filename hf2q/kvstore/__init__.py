"""kvstore"""

"""statemachines"""

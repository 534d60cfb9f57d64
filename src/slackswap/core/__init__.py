"""Framework-free core: data model, units, hardware presets and the roofline cost model.

Nothing under ``slackswap.core`` imports torch; planners and the simulator build on it.
"""

"""The strategy's placement of its parameter server: its PS arguments, checked once (``settings``), where the PS
runs and the worker's connection to it (``connection``), the embedded PS's processes (``ps_launcher``) and its hot
standby on node 1 (``standby_launcher``); the island's process group will live here too. Imports neither Lightning
namespace."""

"""The bench stage (``run = "bench"``): offline acceptance and the online SGLang deploy benchmark."""

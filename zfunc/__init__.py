"""zfunc: ZeRO as composable transforms of pure training steps."""

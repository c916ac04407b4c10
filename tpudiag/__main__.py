from tpudiag.cli import console_main

console_main()

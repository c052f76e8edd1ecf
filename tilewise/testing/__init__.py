"""What the test suite and the scripts share: OpInfo conformance against CPU in every mode
(`conformance`, with its one list of exclusions `opinfo_exclusions`), OpInfo samples through the
compiler (`compiler_conformance`), the differential fuzzer (`fuzzing`, the check against CPU; its
program generator `fuzz_programs`; the interrupts and poisoned buffers it puts into the engine,
`fuzz_interrupts`), the soak loop (`soak`) and a pytest plugin that puts every compiled region on its
native executable (`python -m pytest -p tilewise.testing.native_everywhere`). `import tilewise`
loads none of them; they need the `test` extra (hypothesis, expecttest)."""

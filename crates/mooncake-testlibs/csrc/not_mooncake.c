/*
 * A shared library that is not Mooncake at all: it exports none of the
 * Transfer Engine's symbols. Ferry's tests load it to check that the
 * Mooncake backend says so clearly instead of crashing.
 */
__attribute__((visibility("default"))) int ferry_not_mooncake_answer(void) { return 42; }

__attribute__((visibility("default"))) int initialize(void) { return 0; }

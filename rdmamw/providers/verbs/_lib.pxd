# libibverbs, dlopen()ed once per process (rm_ibverbs.h). Every extension of the
# provider keeps its own table of the library's calls: each hands its filler to
# also_load() when it is imported, and load() fills them all from the library it chose.
ctypedef int (*table_filler)(const char *lib, char *err, size_t errlen) noexcept

cdef int also_load(table_filler fill) except -1
cdef int require() except -1

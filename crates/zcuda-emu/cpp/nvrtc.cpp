// libnvrtc.so for driver.cpp's CPU "GPU": nothing is compiled (the
// kernels were compiled as C++ into libcuda.so), so a program's "PTX" is a
// line saying so followed by its source, which driver.cpp's
// cuModuleLoadData accepts and does not read. Reports version 0.0, so that
// zcuda's kernel cache keys never meet a real NVRTC's PTX.
#include <cstring>
#include <string>

typedef int nvrtcResult;
typedef struct EmuProgram* nvrtcProgram;
struct EmuProgram {
    std::string ptx;
};

namespace {
const nvrtcResult SUCCESS = 0, INVALID_INPUT = 3, INVALID_PROGRAM = 4;
}

extern "C" {

nvrtcResult nvrtcVersion(int* major, int* minor) {
    *major = 0;
    *minor = 0;
    return SUCCESS;
}

nvrtcResult nvrtcCreateProgram(nvrtcProgram* prog, const char* src, const char* name, int,
                               const char* const*, const char* const*) {
    if (!prog || !src) return INVALID_INPUT;
    *prog = new EmuProgram{std::string("// zcuda-emu: not compiled; ") + (name ? name : "") +
                           "'s kernels run on the CPU\n" + src};
    return SUCCESS;
}

nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int, const char* const*) {
    return prog ? SUCCESS : INVALID_PROGRAM;
}

nvrtcResult nvrtcGetPTXSize(nvrtcProgram prog, size_t* size) {
    if (!prog) return INVALID_PROGRAM;
    *size = prog->ptx.size() + 1;
    return SUCCESS;
}

nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char* ptx) {
    if (!prog) return INVALID_PROGRAM;
    std::memcpy(ptx, prog->ptx.c_str(), prog->ptx.size() + 1);
    return SUCCESS;
}

nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t* size) {
    if (!prog) return INVALID_PROGRAM;
    *size = 1;
    return SUCCESS;
}

nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char* log) {
    if (!prog) return INVALID_PROGRAM;
    log[0] = 0;
    return SUCCESS;
}

nvrtcResult nvrtcDestroyProgram(nvrtcProgram* prog) {
    delete *prog;
    *prog = nullptr;
    return SUCCESS;
}

const char* nvrtcGetErrorString(nvrtcResult r) { return r == SUCCESS ? "NVRTC_SUCCESS" : "NVRTC_ERROR"; }

}  // extern "C"

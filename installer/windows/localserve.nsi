; Per-user Windows installer for localserve: no admin rights, everything under
; %LOCALAPPDATA%\localserve. Build (CI does it with Debian's nsis):
;   makensis -DWHEEL_DIR=dist -DWHEEL_NAME=localserve-X-py3-none-any.whl -DOUTFILE=localserve-installer.exe installer/windows/localserve.nsi
; It needs Python 3.10+ through the `py` launcher, makes a venv, installs the bundled wheel with
; its `onnx` extra (onnxruntime-directml on Windows), registers the tray at login through
; `localserve autostart on` (the HKCU Run key; one implementation, in localserve/autostart.py),
; and adds Start-menu entries and an uninstaller. Models live in platformdirs' data dir
; (%LOCALAPPDATA%\localserve\localserve) and survive the uninstaller.

Unicode true
!include "LogicLib.nsh"
!ifndef WHEEL_DIR | WHEEL_NAME
  !error "pass the localserve wheel: makensis -DWHEEL_DIR=dist -DWHEEL_NAME=localserve-X-py3-none-any.whl"
!endif
!ifndef OUTFILE
  !define OUTFILE "localserve-installer.exe"
!endif

Name "localserve"
OutFile "${OUTFILE}"
RequestExecutionLevel user
InstallDir "$LOCALAPPDATA\localserve"
ShowInstDetails show
!define UNINST_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\localserve"
!define PYTHON_URL "https://www.python.org/downloads/windows/"

Section "localserve"
  ; Python first, before anything is written.
  nsExec::ExecToStack 'py -3 -c "import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)"'
  Pop $0
  Pop $1
  ${If} $0 != 0
    MessageBox MB_OK|MB_ICONSTOP "localserve needs Python 3.10 or newer, started by the py launcher.$\r$\nInstall it from ${PYTHON_URL} (tick 'py launcher'), then run this installer again. Nothing was changed."
    Abort
  ${EndIf}

  SetOutPath "$INSTDIR"
  File "${WHEEL_DIR}/${WHEEL_NAME}"
  ; Rerunning upgrades in place: the venv is kept and pip replaces localserve.
  ; (labels, not relative jumps: a plugin call is several instructions)
  IfFileExists "$INSTDIR\venv\Scripts\python.exe" have_venv
  DetailPrint "Creating the environment in $INSTDIR\venv"
  nsExec::ExecToLog 'py -3 -m venv "$INSTDIR\venv"'
  have_venv:
  DetailPrint "Installing localserve (this downloads its dependencies)"
  nsExec::ExecToLog '"$INSTDIR\venv\Scripts\python.exe" -m pip install --disable-pip-version-check --upgrade "$INSTDIR\${WHEEL_NAME}[onnx]"'
  Pop $0
  ${If} $0 != 0
    MessageBox MB_OK|MB_ICONSTOP "Installing localserve failed (pip exit $0). The details pane shows pip's output; rerun the installer to retry."
    Abort
  ${EndIf}
  nsExec::ExecToLog '"$INSTDIR\venv\Scripts\localserve.exe" autostart on'

  CreateDirectory "$SMPROGRAMS\localserve"
  CreateShortcut "$SMPROGRAMS\localserve\localserve tray.lnk" "$INSTDIR\venv\Scripts\pythonw.exe" "-m localserve tray"
  CreateShortcut "$SMPROGRAMS\localserve\localserve chat.lnk" "$INSTDIR\venv\Scripts\localserve.exe" "run"
  CreateShortcut "$SMPROGRAMS\localserve\Uninstall localserve.lnk" "$INSTDIR\uninstall.exe"

  WriteUninstaller "$INSTDIR\uninstall.exe"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayName" "localserve"
  WriteRegStr HKCU "${UNINST_KEY}" "UninstallString" '"$INSTDIR\uninstall.exe"'
  WriteRegStr HKCU "${UNINST_KEY}" "InstallLocation" "$INSTDIR"
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoRepair" 1
SectionEnd

Section "Uninstall"
  nsExec::ExecToLog '"$INSTDIR\venv\Scripts\localserve.exe" autostart off'
  nsExec::ExecToLog '"$INSTDIR\venv\Scripts\localserve.exe" stop'
  RMDir /r "$INSTDIR\venv"
  Delete "$INSTDIR\*.whl"
  Delete "$INSTDIR\uninstall.exe"
  RMDir /r "$SMPROGRAMS\localserve"
  DeleteRegKey HKCU "${UNINST_KEY}"
  ; Downloaded models stay in $INSTDIR\localserve; the folder goes only when empty.
  RMDir "$INSTDIR"
SectionEnd

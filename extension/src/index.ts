/**
 * Stepwise for JupyterLab: the sessions sidebar (left area) and the status-bar cost meter, both
 * drawn from one model that polls the server extension's GET /stepwise/sessions. The status item
 * shows the current notebook's session and what the whole lab spent.
 *
 * Settings (schema/plugin.json): refreshInterval (seconds), currencySymbol, showStatusItem.
 * The settings registry and the status bar are optional: without them the sidebar still works.
 */

import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ISignal, Signal } from '@lumino/signaling';

import { SessionsModel } from './model';
import { fetchReport } from './request';
import { SIDEBAR_ID, SessionsSidebar } from './sidebar';
import { CostStatus } from './status';

const PLUGIN_ID = 'stepwise-lab:plugin';

/** What the status item reads of a document widget's context (DocumentRegistry.IContext). */
interface IDocumentContext {
  readonly path: string;
  readonly pathChanged: ISignal<unknown, string>;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'Stepwise training sessions in a sidebar, and their running cost in the status bar.',
  autoStart: true,
  optional: [ILayoutRestorer, ISettingRegistry, IStatusBar, ILabShell],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    settingRegistry: ISettingRegistry | null,
    statusBar: IStatusBar | null,
    labShell: ILabShell | null
  ) => {
    const model = new SessionsModel({
      fetch: () => fetchReport(app.serviceManager.serverSettings)
    });

    const sidebar = new SessionsSidebar(model);
    app.shell.add(sidebar, 'left', { rank: 650 });
    restorer?.add(sidebar, SIDEBAR_ID);

    let showStatus = true;
    const status = statusBar ? new CostStatus(model) : null;
    const statusToggled = new Signal<typeof plugin, void>(plugin);
    if (statusBar && status) {
      statusBar.registerStatusItem('stepwise-lab:cost', {
        item: status,
        align: 'left',
        rank: 100,
        isActive: () => showStatus,
        activeStateChanged: statusToggled
      });
      // The status item follows the notebook in the current tab (any document with a path), and
      // that document's renames: a rename changes the path, not the current tab.
      let followed: IDocumentContext | null = null;
      const showPath = () => {
        status.notebookPath = followed?.path ?? null;
      };
      const follow = () => {
        followed?.pathChanged.disconnect(showPath);
        const current = labShell?.currentWidget as { context?: IDocumentContext } | null;
        followed = current?.context?.pathChanged ? current.context : null;
        followed?.pathChanged.connect(showPath);
        showPath();
      };
      labShell?.currentChanged.connect(follow);
      follow();
    }

    const apply = (settings: ISettingRegistry.ISettings) => {
      const seconds = settings.get('refreshInterval').composite as number;
      const symbol = settings.get('currencySymbol').composite as string;
      model.interval = Math.max(0.5, seconds) * 1000;
      sidebar.currencySymbol = symbol;
      if (status) {
        status.currencySymbol = symbol;
      }
      showStatus = settings.get('showStatusItem').composite as boolean;
      statusToggled.emit();
    };

    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          apply(settings);
          settings.changed.connect(apply);
        })
        .catch(reason =>
          console.warn('Stepwise: could not load settings; using defaults', reason)
        )
        .finally(() => model.start());
    } else {
      model.start();
    }
  }
};

export default plugin;
